#!/usr/bin/env python3
"""Prints YaRN's inverse frequencies and attention factor as transformers computes them
(`_compute_yarn_parameters` in transformers/modeling_rope_utils.py, transcribed line by line
with Python floats in place of torch tensors), for the unit test in
crates/keydiff-model/src/rope.rs:

    python3 scripts/yarn-reference.py

Cases: Qwen 2.5 (head 64, theta 1e6, factor 4 from 32768, the model card's setting) and a
Llama-shaped head (128, theta 5e5, factor 8 from 8192, betas 16 and 2, mscale 0.707 over
mscale_all_dim 1).
"""

import math


def yarn(dim, base, factor, original, beta_fast=None, beta_slow=None, attention_factor=None,
         mscale=None, mscale_all_dim=None, truncate=True):
    def get_mscale(scale, mscale=1):
        if scale <= 1:
            return 1.0
        return 0.1 * mscale * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = beta_fast or 32
    beta_slow = beta_slow or 1

    def find_correction_dim(num_rotations, dim, base, max_position_embeddings):
        return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    def find_correction_range(low_rot, high_rot, dim, base, max_position_embeddings, truncate):
        low = find_correction_dim(low_rot, dim, base, max_position_embeddings)
        high = find_correction_dim(high_rot, dim, base, max_position_embeddings)
        if truncate:
            low = math.floor(low)
            high = math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def linear_ramp_factor(lo, hi, dim):  # transformers names them min and max
        if lo == hi:
            hi += 0.001
        return [min(max((i - lo) / (hi - lo), 0.0), 1.0) for i in range(dim)]

    pos_freqs = [base ** (i / dim) for i in range(0, dim, 2)]
    inv_freq_extrapolation = [1.0 / p for p in pos_freqs]
    inv_freq_interpolation = [1.0 / (factor * p) for p in pos_freqs]
    low, high = find_correction_range(beta_fast, beta_slow, dim, base, original, truncate)
    inv_freq_extrapolation_factor = [1 - r for r in linear_ramp_factor(low, high, dim // 2)]
    inv_freq = [
        i * (1 - e) + x * e
        for i, x, e in zip(inv_freq_interpolation, inv_freq_extrapolation, inv_freq_extrapolation_factor)
    ]
    return inv_freq, attention_factor


for name, args in [
    ("qwen", dict(dim=64, base=1e6, factor=4.0, original=32768)),
    ("llama", dict(dim=128, base=5e5, factor=8.0, original=8192, beta_fast=16, beta_slow=2,
                   mscale=0.707, mscale_all_dim=1.0)),
]:
    inv, att = yarn(**args)
    print(f"{name}: attention_factor = {att!r}")
    print(f"{name}: inv_freq = [{', '.join(f'{x:.9e}' for x in inv)}]")
