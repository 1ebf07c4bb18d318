#!/usr/bin/env bash
# Mutation check of the emulated kernel tests (crates/keydiff-cache/tests/kernel_emulation.rs,
# and crates/keydiff-model/tests/model_kernels_emulation.rs for the model's kernels):
# plants one known defect at a time in kernels/keydiff.cu (an off-by-one, a missing barrier, a
# wrong reduction, ...), runs the tests, and reports whether they caught it. Every mutant must
# be caught. kernels/keydiff.cu is restored afterwards, whatever happens.
# Usage: scripts/kernel-mutants.sh      (~40 s per mutant on 2 cores after the first build)
#        MUTANTS_MATCHING=select-many scripts/kernel-mutants.sh   (only those names)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
src=kernels/keydiff.cu
orig=$(mktemp); cp "$src" "$orig"
trap 'cp "$orig" "$src"; rm -f "$orig"' EXIT

# name ~ exact text ~ replacement (\n: newline)
mutants=(
  "select: keep only keys above the threshold~i < n && key(i) >= threshold;~i < n && key(i) > threshold;"
  "select: recent window one short~(has_recent && p >= recent_min)~(has_recent && p > recent_min)"
  "select: hole offset ignores lower lanes~      om += sh.warp_total[1][w];\n    }\n    oh += __popc(bh & below);~      om += sh.warp_total[1][w];\n    }\n    oh += __popc(bh);"
  "select: no barrier after the digit is chosen~    mask |= 255ull << shift;\n    __syncthreads();~    mask |= 255ull << shift;"
  "scores: no barrier before the warp partials are summed~  if (lane == 0) partial[warp] = ss;\n  __syncthreads();~  if (lane == 0) partial[warp] = ss;"
  "scores: warp sum skips the lane-16 step~float kd_warp_sum(float v) {\n  for (int o = 16; o > 0;~float kd_warp_sum(float v) {\n  for (int o = 8; o > 0;"
  "moves: copies half of each 16-byte-aligned row~j < row_bytes / 16; j += 32~j < row_bytes / 32; j += 32"
  "snapkv: pooling window one short~j <= min(r + KD_POOL_HALF, last)~j < min(r + KD_POOL_HALF, last)"
  "snapkv: word-rank scan drops the carry between passes~    unsigned off = base;~    unsigned off = 0;"
  "moves: no bound on the rows a plan names~  if (src >= (uint32_t)rows || dst >= (uint32_t)rows) return;~  (void)rows;"
  "moves: the bound on rows one too far~  if (src >= (uint32_t)rows || dst >= (uint32_t)rows) return;~  if (src > (uint32_t)rows || dst > (uint32_t)rows) return;"
  "snapkv: no bound on the bitmap a position sets~    if ((p >> 5) < (uint32_t)words) atomicOr(~    atomicOr("
  "snapkv: window over slots that were never ranked~    const int last = min(n, (int)base) - 1;~    const int last = n - 1;"
  "scores: a lane's anchor share past the first 32 elements dropped~    if (lane + 32 * c < d) atomicAdd(~    if (lane + 32 * c < 32) atomicAdd("
  "scores: rows read past the row (d < 256)~      x[b][c] = r < row_end && j < d ? kd_to_f(k[j]) : 0.f;~      x[b][c] = r < row_end && j < d + 32 ? kd_to_f(k[j]) : 0.f;"
  "scores: rows read one past the block's last row~      x[b][c] = r < row_end && j < d ? kd_to_f(k[j]) : 0.f;~      x[b][c] = r <= row_end && j < d ? kd_to_f(k[j]) : 0.f;"
  "scores: a batch's rows half a warp count apart~    const int r = rb + b * step;~    const int r = rb + b * (step / 2);"
  "scores: pass 1 goes on past the block's last row~      if (r >= row_end) break;\n      const float norm~      const float norm"
  "scores: pass 2 skips the last row~      const int r = rb + b * warps;\n      float dot = 0.f;\n~      const int r = rb + b * warps;\n      if (r == n - 1) continue;\n      float dot = 0.f;\n"
  "scores: anchor accumulator never zeroed~  for (int j = threadIdx.x; j < d; j += blockDim.x) acc[j] = 0.f;~  (void)acc;\n  (void)d;"
  "select: plan offsets never reset~  if (threadIdx.x == 0) sh.base[0] = sh.base[1] = 0;\n~"
  "snapkv: rank offset never reset~  if (threadIdx.x == 0) base = 0;\n~"
  "scores: accumulator zeroed one past d (shared memory out of bounds at d = 256)~  for (int j = threadIdx.x; j < d; j += blockDim.x) acc[j] = 0.f;~  for (int j = threadIdx.x; j <= d; j += blockDim.x) acc[j] = 0.f;"
  "select: key read before the bound check (values unused past n)~      if (i < n) {\n        const uint64_t x = key(i);~      const uint64_t x = key(i);\n      if (i < n) {"
  # Missing barriers, one at a time (each a race the memory checker reports, whatever the
  # values; two give right answers under every schedule the tests draw). The barrier after
  # `sh.base` is zeroed in keydiff_select_plan is not among them: the loop's first barrier
  # already orders that write before any read, so removing it is not a defect.
  "scores: no barrier after the accumulator is zeroed~acc[j] = 0.f;\n  __syncthreads();~acc[j] = 0.f;"
  "scores: no barrier before the block's sums go out~                                                int h, int d) {\n  __syncthreads();~                                                int h, int d) {"
  "select: no barrier after the histogram is cleared~j < 256; j += blockDim.x) sh.hist[j] = 0;\n    __syncthreads();~j < 256; j += blockDim.x) sh.hist[j] = 0;"
  "select: no barrier before the digit is chosen~        atomicAdd(&sh.hist[bin], (unsigned)__popc(peers));\n    }\n    __syncthreads();\n    if (threadIdx.x == 0) {~        atomicAdd(&sh.hist[bin], (unsigned)__popc(peers));\n    }\n    if (threadIdx.x == 0) {"
  "select: no barrier after the threshold is read~  const uint64_t r = sh.prefix;\n  __syncthreads();~  const uint64_t r = sh.prefix;"
  "select: no barrier after the warp totals are written~      sh.warp_total[1][warp] = __popc(bm);\n    }\n    __syncthreads();~      sh.warp_total[1][warp] = __popc(bm);\n    }"
  "select: no barrier before the offsets advance~src[om] = (uint32_t)i;\n    __syncthreads();\n    if (threadIdx.x == 0) {\n      for (int w = 0;~src[om] = (uint32_t)i;\n    if (threadIdx.x == 0) {\n      for (int w = 0;"
  "select: no barrier after the offsets advance~        sh.base[1] += sh.warp_total[1][w];\n      }\n    }\n    __syncthreads();~        sh.base[1] += sh.warp_total[1][w];\n      }\n    }"
  "snapkv: no barrier after the bitmap is built~  if (threadIdx.x == 0) base = 0;\n  __syncthreads();~  if (threadIdx.x == 0) base = 0;"
  "snapkv: no barrier after the scan's warp totals~    if (lane == 31) warp_total[warp] = x;\n    __syncthreads();~    if (lane == 31) warp_total[warp] = x;"
  "snapkv: no barrier before the scan's offset advances~    if (w < words) wr[w] = off + x - c;\n    __syncthreads();~    if (w < words) wr[w] = off + x - c;"
  "snapkv: no barrier after the scan's offset advances~      for (int v = 0; v < warps; ++v) base += warp_total[v];\n    }\n    __syncthreads();~      for (int v = 0; v < warps; ++v) base += warp_total[v];\n    }"
  "snapkv: no barrier before the windows read the ranking~    srt[r] = (uint32_t)i;\n  }\n  __syncthreads();~    srt[r] = (uint32_t)i;\n  }"
  # The 16-byte-load scoring kernels (keydiff_pass1v / keydiff_pass2v).
  "scores-vec: a lane's second vector of a row read from the wrong place (f32, d 256)~raw[b][v] = row[place + G::kLanes * v];~raw[b][v] = row[place + v];"
  "scores-vec: rows read one past the block's last row~      if (r < row_end) {\n        raw[b][v]~      if (r <= row_end) {\n        raw[b][v]"
  "scores-vec: a row's sum over half its lanes~  for (int o = L / 2; o > 0; o >>= 1)~  for (int o = L / 4; o > 0; o >>= 1)"
  "scores-vec: the anchor shares of the warp's other rows never added~  for (int o = G::kLanes; o < 32; o <<= 1)~  for (int o = 32; o < 32; o <<= 1)"
  # (Swapping the two values of every bf16 pair would be an equivalent mutant: a cosine does
  # not change when keys and anchor have their coordinates permuted alike.)
  "scores-vec: bf16 low values read from the high halves~    out[2 * i] = __uint_as_float(w[i] << 16);~    out[2 * i] = __uint_as_float(w[i] & 0xffff0000u);"
  "scores-vec: f16 values unpacked from the wrong halves~(unsigned short)(w[i] & 0xffffu)~(unsigned short)(w[i] >> 16)"
  "scores-vec: norms written by every lane of a row~        if (place == 0) norms[~        norms["
  "scores-vec: a lane's anchor values taken from the wrong elements~      m[v * G::kElems + e] = mu[(place + G::kLanes * v) * G::kElems + e];~      m[v * G::kElems + e] = mu[(place + G::kLanes * v) * G::kElems];"
  "scores-vec: the anchor share of a lane's second vector lost (f32, d 256)~    for (int v = 0; v < G::kPerLane; ++v)\n      for (int e = 0; e < G::kElems; ++e)\n        atomicAdd(~    for (int v = 0; v < 1; ++v)\n      for (int e = 0; e < G::kElems; ++e)\n        atomicAdd("
  "scores-vec: pass 2 writes a score for a row past the block's last~      if (r < row_end && place == 0)~      if (place == 0)"
  "scores-vec: a warp reduces only the first load of a batch~      if (rb + b * step >= row_end) break;\n      float x[G::kVals];~      if (b > 0 || rb >= row_end) break;\n      float x[G::kVals];"
  "scores-vec: the rows of one load not told apart~      f(rb + b * step + sub, x);~      f(rb + b * step + 0 * sub, x);"
  # (Bounding pass 1's rows by n instead of the block's last row would be an equivalent
  # mutant: a warp-wide load only runs past the block's rows in the last block, where both
  # bounds are n.)
  "scores-vec: pass 1 writes norms for the rows past n of the last load~                      if (r < row_end) {\n                        if (place == 0) norms[~                      if (true) {\n                        if (place == 0) norms["
  # The many-block selection (keydiff_select_pass / _count / _emit).
  "select-many: count keeps only keys above the threshold~    const bool keep = key(i) >= threshold;~    const bool keep = key(i) > threshold;"
  "select-many: hole offset ignores lower lanes~      om += warp_total[1][v];\n    }\n    oh += __popc(bh & below);~      om += warp_total[1][v];\n    }\n    oh += __popc(bh);"
  "select-many: no barrier before the emit offsets advance~src[om] = (uint32_t)i;\n    __syncthreads();\n    if (threadIdx.x == 0) {\n      for (int v = 0;~src[om] = (uint32_t)i;\n    if (threadIdx.x == 0) {\n      for (int v = 0;"
  "select-many: the last block named one ticket early~    last = atomicAdd(ticket, 1u) == gridDim.x - 1;~    last = atomicAdd(ticket, 1u) == gridDim.x - 2;"
  "select-many: the first block, not the last, finishes a launch~    last = atomicAdd(ticket, 1u) == gridDim.x - 1;~    last = atomicAdd(ticket, 1u) == 0;"
  "select-many: a finished stage is not carried on~out[threadIdx.x] = in[threadIdx.x];~(void)out;"
  "select-many: the recent window's result is not passed on~    out[4] = recent_stage ? (done ? (uint32_t)np : 0u) : recent_min;~    out[4] = recent_stage ? 0u : recent_min;"
  "select-many: upper bins of a slice never reach the head's histogram~    if (hist[j]) atomicAdd(&gh[j], hist[j]);~    if (hist[j] && j < 1024) atomicAdd(&gh[j], hist[j]);"
  "select-many: the digit's bin found one too low~    if (above < k && above + v[c] >= k) {~    if (above < k && above + v[c] > k) {"
  "select-many: keys outside the prefix counted from the second digit on~  const uint64_t mask = hi >= 64 ? 0ull :~  const uint64_t mask = hi >= 53 ? 0ull :"
  "select-many: mover offsets scanned from the hole counts~om = kd_sel_block_scan(cm, tmp);~om = kd_sel_block_scan(ch, tmp);"
  "select-many: slices with movers but no holes skipped~  if (counts[2 * blockIdx.x] == 0 && counts[2 * blockIdx.x + 1] == 0) return;~  if (counts[2 * blockIdx.x] == 0) return;"
  "select-many: no barrier after the slice histogram is cleared~hist[j] = 0;\n  __syncthreads();~hist[j] = 0;"
  "select-many: no barrier before the slice histogram goes out~      atomicAdd(&hist[bin], (unsigned)__popc(peers));\n  }\n  __syncthreads();~      atomicAdd(&hist[bin], (unsigned)__popc(peers));\n  }"
  "select-many: block scan reads warp totals before they are written~  if (lane == 31) tmp[warp] = x;\n  __syncthreads();~  if (lane == 31) tmp[warp] = x;"
  "select-many: block sum reuses its totals without a barrier~  for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += tmp[w];\n  __syncthreads();~  for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += tmp[w];"
  # The decode-attention kernels (keydiff_decode_*, keydiff_decode_combine_*), caught by
  # keydiff-model's tests/model_kernels_emulation.rs (the mutants named "decode: ...").
  "decode: the running sums not rescaled by a new max~acc[j][e] = acc[j][e] * c + w * vx[e];~acc[j][e] = acc[j][e] + w * vx[e];"
  "decode: the running weight not rescaled by a new max~        l[j] = l[j] * c + w;~        l[j] = l[j] + w;"
  "decode: a block drops its last key~(long long)r0 + span);~(long long)r0 + span - 1);"
  "decode: a score of -inf not weighed 0~const bool none = mn == kd_neg_inf() && p == kd_neg_inf();~const bool none = mn == kd_neg_inf() && p != p;"
  "decode: a NaN score as the first key dropped~const bool none = mn == kd_neg_inf() && p == kd_neg_inf();~const bool none = mn == kd_neg_inf();"
  "decode: q scaled by the square root of the scale~kd_to_f(q[((int64_t)h * g + j) * d + c]) * scale~kd_to_f(q[((int64_t)h * g + j) * d + c]) * sqrtf(scale)"
  "decode: value rows at the key rows' strides~    return kd_to_f(v[h * v_hs + (int64_t)r * v_rs + c]);~    return kd_to_f(v[h * k_hs + (int64_t)r * k_rs + c]);"
  "decode: no barrier before the warps are merged~      for (int e = 0; e < NE; ++e) sm_acc[j][lane + 32 * e][warp] = acc[j][e];\n    }\n  }\n  __syncthreads();~      for (int e = 0; e < NE; ++e) sm_acc[j][lane + 32 * e][warp] = acc[j][e];\n    }\n  }"
  "decode: a merge without its max~    const float f = expf(m[i * step] - mx);~    const float f = expf(m[i * step]);"
  "decode: the combine reads splits one head apart~  const int step = g * (d + 2);~  const int step = d + 2;"
  "decode: only the first warp's keys merged~  for (int i = 0; i < n; ++i) mx = fmaxf(mx, m[i * step]);~  n = n > 1 && step == 1 ? 1 : n;\n  for (int i = 0; i < n; ++i) mx = fmaxf(mx, m[i * step]);"
  "decode: an element past the head dim read as a value~      vx[e] = c < d ? rows.value(h, r, c) : 0.f;~      vx[e] = c < d + 32 ? rows.value(h, r, c) : 0.f;"
  # The block dequantization the cache's dequantize kernel and the decode kernel over blocks
  # share (kd_kvq_value), caught by keydiff-cache's codec tests.
  "kvq: q5's fifth bit taken from the next value~    code |= (int)((qh >> j) & 1u) << 4;~    code |= (int)((qh >> ((j + 1) & 31)) & 1u) << 4;"
  "kvq: bf16 writes rounded from a value 1e-4 off~  *p = __float2bfloat16_rn(x);~  *p = __float2bfloat16_rn(x * 1.0001f);"
  "kvq: a block's minimum not added~  if (with_min) return __fadd_rn(__fmul_rn((float)code, scale), kd_get_f16(blk + 2));~  if (with_min) return __fmul_rn((float)code, scale);"
  # The decode kernel over quantized caches (keydiff_decode_kvq_*), caught by the decode tests.
  "decode: (blocks) value blocks at the key rows' strides~    return kd_kvq_value(v + h * v_hs + (int64_t)r * v_rs + (c / KD_KVQ_BLOCK) * bytes, kind,~    return kd_kvq_value(v + h * k_hs + (int64_t)r * k_rs + (c / KD_KVQ_BLOCK) * bytes, kind,"
  "decode: (blocks) a key's third block read as its first~    return kd_kvq_value(k + h * k_hs + (int64_t)r * k_rs + (c / KD_KVQ_BLOCK) * bytes, kind,~    return kd_kvq_value(k + h * k_hs + (int64_t)r * k_rs + (c / KD_KVQ_BLOCK % 2) * bytes, kind,"
  "decode: (blocks) every block taken as 32 bytes~v_hs, v_rs, kind, kd_kvq_bytes(kind)};~v_hs, v_rs, kind, 32};"
  "decode: (blocks) a key's value at another place of its block~    return kd_kvq_value(k + h * k_hs + (int64_t)r * k_rs + (c / KD_KVQ_BLOCK) * bytes, kind,\n                        c % KD_KVQ_BLOCK);~    return kd_kvq_value(k + h * k_hs + (int64_t)r * k_rs + (c / KD_KVQ_BLOCK) * bytes, kind,\n                        (c + 1) % KD_KVQ_BLOCK);"
  # The causal softmax of eager chunk attention (keydiff_causal_softmax_*), caught by
  # keydiff-model's tests/model_kernels_emulation.rs (the mutants named "softmax: ...").
  "softmax: each query sees one key too few~return t - chunk + q + 1;~return t - chunk + q;"
  "softmax: a chunk's queries taken from its end~  const int seen = kd_smx_seen(t, chunk, (int)(row % chunk));~  const int seen = kd_smx_seen(t, chunk, chunk - 1 - (int)(row % chunk));"
  "softmax: the running sum not rescaled by a new max~      l = l * expf(m - v) + 1.f;~      l = l + 1.f;"
  "softmax: a score of -inf not weighed 0~    } else if (v != kd_neg_inf()) {~    } else {"
  "softmax: states merged without rescaling~  l = l * a + l2 * b;~  l = l + l2 + 0.f * (a + b);"
  "softmax: the lane-16 step of the warp merge skipped~  for (int o = 16; o > 0; o >>= 1) {\n    const float m2~  for (int o = 8; o > 0; o >>= 1) {\n    const float m2"
  "softmax: no barrier before the warps' states are merged~    sm_l[warp] = l;\n  }\n  __syncthreads();~    sm_l[warp] = l;\n  }"
  "softmax: only the first warp's state~  for (int w = 1; w < KD_SMX_WARPS; ++w) kd_smx_merge~  for (int w = 1; w < 1; ++w) kd_smx_merge"
  "softmax: the first masked key weighed~    kd_store(&y[c], c < seen ?~    kd_store(&y[c], c <= seen ?"
  # The softmax with the policies' statistics (keydiff_softmax_state_* / _sums_*), caught by the
  # same tests (the mutants named "sums: ..."). Its pass 1 is the softmax's own (above).
  "sums: a row's state from another row's query~  kd_smx_state(s + row * t, kd_smx_seen(t, chunk, (int)(row % chunk)), m, l);~  kd_smx_state(s + row * t, kd_smx_seen(t, chunk, (int)(row % chunk) / 2), m, l);"
  "sums: divided by the max, not the sum~ - state[2 * row]) / state[2 * row + 1]~ - state[2 * row]) / state[2 * row]"
  "sums: the first masked key weighed~c < kd_smx_seen(t, chunk, q) ? expf~c <= kd_smx_seen(t, chunk, q) ? expf"
  "sums: the first counted query not summed~    if (q >= counted) acc += v;~    if (q > counted) acc += v;"
  "sums: one query too many counted~  const int counted = chunk - stat_rows;~  const int counted = max(chunk - stat_rows - 1, 0);"
  "sums: without probabilities, the first counted query skipped~p != nullptr ? 0 : counted; q0 < chunk;~p != nullptr ? 0 : counted + 1; q0 < chunk;"
  "sums: a batch reads past the head's last query~const bool read = q < chunk && c <~const bool read = c <"
  "sums: a batch computes past the head's last query~b < KD_SMX_BATCH && q0 + b < chunk; ++b~b < KD_SMX_BATCH; ++b"
  "sums: every head's statistics in the first head's row~  stats[head * t + c] = acc;~  stats[c] = acc;"
  "sums: keys past t~  if (c >= t) return;\n  const int counted~  if (c > t) return;\n  const int counted"
  # The residual add and RMSNorm (keydiff_add_rms_norm_*), caught by keydiff-model's
  # tests/model_kernels_emulation.rs (the mutants named "norm: ...").
  "norm: eps outside the root~  const float scale = rsqrtf(total / cols + eps);~  const float scale = rsqrtf(total / cols) + eps;"
  "norm: the mean over one value too few~  const float scale = rsqrtf(total / cols + eps);~  const float scale = rsqrtf(total / (cols - 1) + eps);"
  "norm: no barrier before the warps' sums are added~  if (lane == 0) warp_sums[warp] = ss;\n  __syncthreads();~  if (lane == 0) warp_sums[warp] = ss;"
  "norm: the lane-16 step of the warp sum skipped~  for (int o = 16; o > 0; o >>= 1) ss +=~  for (int o = 8; o > 0; o >>= 1) ss +="
  "norm: the residual not added~    kd_store(&s[c], kd_to_f(xr[c]) + kd_to_f(rr[c]));~    kd_store(&s[c], kd_to_f(xr[c]) + 0.f * kd_to_f(rr[c]));"
  "norm: every value weighed by the first weight~    kd_store(&y[c], scale * kd_to_f(s[c]) * kd_to_f(w[c]));~    kd_store(&y[c], scale * kd_to_f(s[c]) * kd_to_f(w[0]));"
  "norm: the norms written over the sums~  T* y = out + ((int64_t)rows + row) * cols;~  T* y = out + (int64_t)row * cols + 0 * rows;"
  "norm: the squares of the unrounded sums~    const float v = kd_to_f(s[c]);~    const float v = kd_to_f(xr[c]) + kd_to_f(rr[c]);"
  # SwiGLU's product (keydiff_silu_mul_*), caught by keydiff-model's
  # tests/model_kernels_emulation.rs (the mutants named "silu: ...").
  "silu: e^g in place of e^-g~    kd_store(&out[i], g / (1.f + expf(-g)) * u);~    kd_store(&out[i], g / (1.f + expf(g)) * u);"
  "silu: up read at gate's row stride~    const float u = kd_to_f(up[r * up_rs + c]);~    const float u = kd_to_f(up[r * gate_rs + c + 0 * up_rs]);"
  "silu: the last value left unwritten~  for (int64_t i = (int64_t)blockIdx.x * KD_ACT_THREADS + threadIdx.x; i < n;~  for (int64_t i = (int64_t)blockIdx.x * KD_ACT_THREADS + threadIdx.x; i < n - 1;"
  "silu: the grid-stride loop steps a block too far~       i += (int64_t)gridDim.x * KD_ACT_THREADS) {~       i += (int64_t)(gridDim.x + 1) * KD_ACT_THREADS) {"
  "silu: columns counted past the row~    const int64_t r = i / cols, c = i % cols;~    const int64_t r = i / cols, c = i % cols + (i % cols == cols - 1);"
  # Greedy sampling on the device (keydiff_argmax_rows_*), caught by keydiff-model's
  # tests/model_kernels_emulation.rs (the mutants named "argmax: ...").
  "argmax: ties keep the higher index~  return bi == KD_ARGMAX_NONE || v > bv || (v == bv && i < bi);~  return bi == KD_ARGMAX_NONE || v > bv || (v == bv && i > bi);"
  "argmax: a later equal value wins~  return bi == KD_ARGMAX_NONE || v > bv || (v == bv && i < bi);~  return bi == KD_ARGMAX_NONE || v >= bv || (v == bv && i < bi);"
  "argmax: a thread with no values competes with its placeholder~  if (i == KD_ARGMAX_NONE || isnan(v)) return false;~  if (isnan(v)) return false;"
  "argmax: NaN not skipped~  if (i == KD_ARGMAX_NONE || isnan(v)) return false;~  if (i == KD_ARGMAX_NONE) return false;"
  "argmax: a row starting with NaN not sent to 0~    if (lane == 0) out[blockIdx.x] = bi == KD_ARGMAX_NONE || isnan(kd_to_f(row[0])) ? 0u : bi;~    if (lane == 0) out[blockIdx.x] = bi == KD_ARGMAX_NONE ? 0u : bi;"
  "argmax: the last value of a row not read~  for (int c = threadIdx.x; c < cols; c += KD_ARGMAX_THREADS) {~  for (int c = threadIdx.x; c < cols - 1; c += KD_ARGMAX_THREADS) {"
  "argmax: the lane-1 step of the warp shuffle skipped~  for (int o = 16; o > 0; o >>= 1) {\n    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);~  for (int o = 16; o > 1; o >>= 1) {\n    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);"
  "argmax: only the first warp's winner read~    bv = lane < KD_ARGMAX_THREADS / 32 ? s_val[lane] : 0.f;~    bv = lane < 1 ? s_val[lane] : 0.f;"
  "argmax: no barrier before the warps' winners are read~    s_idx[warp] = bi;\n  }\n  __syncthreads();~    s_idx[warp] = bi;\n  }"
  # Sampling on the device (keydiff_sample_rows_*), caught by keydiff's
  # tests/sample_emulation.rs (the mutants named "sample: ..."). Not among them: weights
  # truncated instead of rounded, the top-p and draw comparisons one step looser (>, <=), the
  # fallback to the last key, min-p's "the first always", the mask of the index's high digits:
  # each differs only where the fixed-point sums tie a goal exactly or bits are 0 anyway.
  "sample: keys ascending with the logit~  return ((unsigned long long)desc << 32) | i;~  return ((unsigned long long)(0xffffffffu - desc) << 32) | i;"
  "sample: -0 and +0 keyed alike~(b & 0x80000000u) ? b : b ^ 0x7fffffffu;~(b & 0x80000000u) ? (b == 0x80000000u ? 0x7fffffffu : b) : b ^ 0x7fffffffu;"
  "sample: the temperature ignored~  return (unsigned long long)(exp((double)(l - mx) / t) * KD_SAMPLE_UNIT + 0.5);~  return (unsigned long long)(exp((double)(l - mx) / (t / t)) * KD_SAMPLE_UNIT + 0.5);"
  "sample: min-p's test the other way round~exp((double)(l - mx) / tc) >= min_p)) {~exp((double)(l - mx) / tc) < min_p)) {"
  "sample: min-p at temperature 1 in vLLM's order~exp((double)(l - mx) / tc) >= min_p)) {~exp((double)(l - mx) / (tc / tc)) >= min_p)) {"
  "sample: top-p at temperature 1 in vLLM's order~kmin, mx, 1, tc,~kmin, mx, 1, 1.0,"
  "sample: top-k not applied~  if (top_k > 0 && top_k < count)\n    cut = ~  if (top_k > 0 && top_k < count)\n    (void)"
  "sample: top-p not applied~  if (top_p < 1.f)\n    cut = ~  if (top_p < 1.f)\n    (void)"
  "sample: top-k keeps one too many~                           (double)top_k, sh);~                           (double)top_k + 1, sh);"
  "sample: the goal not scaled by the total~        target = goal * (double)total;~        target = goal;"
  "sample: the running weight without the bins before~        before += h;~        (void)h;"
  "sample: the index's middle digit skipped~last_id < (1u << 16) ? 8~last_id < (1u << 16) ? 0"
  "sample: a row with no finite logit not flagged~    if (threadIdx.x == 0) out[blockIdx.x] = sh.argmax | (greedy ? 0u : KD_SAMPLE_NO_DRAW);~    if (threadIdx.x == 0) out[blockIdx.x] = sh.argmax;"
  "sample: the index's top_shift boundary off by one~last_id < (1u << 8) ? 0~last_id <= (1u << 8) ? 0"
  "sample: a row starting with NaN not sent to 0~    sh.argmax = bi == KD_ARGMAX_NONE || isnan(kd_to_f(row[0])) ? 0u : bi;~    sh.argmax = bi == KD_ARGMAX_NONE ? 0u : bi;"
  "sample: counts one a bin a warp touches~(unsigned long long)__popc(peers)~1ull"
  "sample: only the first warp's count and first key~    for (int w = 1; w < KD_SAMPLE_THREADS / 32; ++w) {~    for (int w = 1; w < 1; ++w) {"
  "sample: no barrier after the histogram is filled~        atomicAdd(&sh.hist[bin], w);\n      }\n    }\n    __syncthreads();~        atomicAdd(&sh.hist[bin], w);\n      }\n    }"
  "sample: no barrier before the chosen digit is read~    __syncthreads();\n    prefix = sh.prefix;~    prefix = sh.prefix;"
  # The one-launch selection of few evictions (keydiff_select_few). Two of its barriers are
  # not among them: the one at the end of each digit of kd_few_kth (the next digit's reads and
  # writes of the shared state come after two barriers of its own) and the one after the last
  # block loads its candidates (kd_few_kth's first barrier orders those stores before any
  # read). Removing either is not a defect; both mutants survive (session 44).
  "select-few: candidates one short of m + recent~  const int c = min(m + recent, KD_FEW_ITEMS), rr~  const int c = min(m + recent - 1, KD_FEW_ITEMS), rr"
  "select-few: candidates blind to the window~  const int c = min(m + recent, KD_FEW_ITEMS), rr~  const int c = min(m, KD_FEW_ITEMS), rr"
  "select-few: the window's lowest position left inexact~    recent_min = kd_few_min(low, sh.tmp);~    recent_min = kd_few_min(low, sh.tmp) * 0u + (uint32_t)t;"
  "select-few: candidates read without atomics~list[j] = atomicAdd(&cand[j], 0u);~list[j] = cand[j];"
  "select-few: the tail bitmap never cleared~  for (int j = threadIdx.x; j < (m + 31) / 32; j += blockDim.x) tail[j] = 0;\n~"
  "select-few: holes include the slot at the budget~      count, [&](int i) { return (int)list[i] < budget && inv(i) >= t; },~      count, [&](int i) { return (int)list[i] <= budget && inv(i) >= t; },"
  "select-few: movers taken from the evicted tail slots~      m, [&](int j) { return ((tail[j >> 5] >> (j & 31)) & 1u) == 0; },~      m, [&](int j) { return ((tail[j >> 5] >> (j & 31)) & 1u) != 0; },"
  "select-few: compaction ranks ignore lower lanes~    unsigned rank = base + (unsigned)__popc(bits & ((1u << lane) - 1u)), total = 0;~    unsigned rank = base + (unsigned)__popc(bits), total = 0;"
  "select-few: the last slice's candidates counted as a full slice's~  const int count = (slices - 1) * c + min(c, n - last);~  const int count = slices * c;"
  "select-few: the digit's bin found one too low~    if (above < k && above + v0 >= k) {~    if (above < k && above + v0 > k) {"
  "select-few: the second bin of a thread never searched~    if (above < k && above + v1 >= k) {~    if (false && above < k && above + v1 >= k) {"
  # The append kernel (keydiff_append_rows) and the row copy it shares with the moves.
  "append: positions counted from pos0 + slot~    positions[h * meta_hs + slot + r] = pos0 + (uint32_t)r;~    positions[h * meta_hs + slot + r] = pos0 + (uint32_t)(slot + r);"
  "append: the policy state of new slots left as it was~    state[h * meta_hs + slot + r] = 0.f;~    state[h * meta_hs + slot + r] += 0.f;"
  "append: values read with head and row strides swapped~  kd_copy_row(vbuf + to, v + h * v_hs + (int64_t)r * v_rs, row_bytes, lane);~  kd_copy_row(vbuf + to, v + h * v_rs + (int64_t)r * v_hs, row_bytes, lane);"
  "append: the chunk's last row dropped~  if (r >= chunk) return;\n  const int64_t to~  if (r >= chunk - 1) return;\n  const int64_t to"
  "append: rows written a slot early~  const int64_t to = h * buf_hs + (int64_t)(slot + r) * buf_rs;~  const int64_t to = h * buf_hs + (int64_t)(slot + r - 1) * buf_rs;"
  "append: blocks cover half a block's rows~  const int r = blockIdx.x * (KD_APPEND_THREADS / 32) + (threadIdx.x >> 5);~  const int r = blockIdx.x * (KD_APPEND_THREADS / 64) + (threadIdx.x >> 5);"
  "copy-row: half of each 4-byte-word row~j < row_bytes / 4; j += 32~j < row_bytes / 8; j += 32"
  # RoPE of queries and keys (keydiff_rope_qk_*).
  "rope: x2 · s added in the first value~    kd_store(&y[i1], kd_round(x1 * c, y) - kd_round(x2 * s, y));~    kd_store(&y[i1], kd_round(x1 * c, y) + kd_round(x2 * s, y));"
  "rope: an interleaved pair's second value one too far~i2 = interleaved ? 2 * j + 1 : j + half;~i2 = interleaved ? 2 * j + 2 : j + half;"
  "rope: row 0's cos for every row~    const float c = kd_to_f(cos[t * half + j]),~    const float c = kd_to_f(cos[j]),"
  "rope: products not rounded to the dtype~    kd_store(&y[i2], kd_round(x1 * s, y) + kd_round(x2 * c, y));~    kd_store(&y[i2], x1 * s + x2 * c);"
  "rope: the grid-stride loop stops after one turn~       i += (int64_t)gridDim.x * KD_ROPE_THREADS) {\n    const int j = (int)(i % half);~       i += pairs) {\n    const int j = (int)(i % half);"
  "rope: output rows in the input's order~    T* y = out + row * d;~    T* y = out + ((int64_t)t * (hq + hk) + h) * d;"
  "rope: key heads one past~    const T* x = h < hq ? q + t * q_rs + h * q_hs : k + t * k_rs + (h - hq) * k_hs;~    const T* x = h < hq ? q + t * q_rs + h * q_hs : k + t * k_rs + (h - hq + 1) * k_hs;"
  "copy-row: the last byte of a byte row~    for (int j = lane; j < row_bytes; j += 32) to[j] = from[j];~    for (int j = lane; j < row_bytes - 1; j += 32) to[j] = from[j];"
)
# Every mutant's text must occur exactly once in the source (a kernel added later may repeat
# a line): checked for all of them before anything runs.
printf '%s\n' "${mutants[@]}" | python3 -c '
import sys
src = open(sys.argv[1]).read()
bad = [f"{src.count(old)}x  {name}" for name, old, _ in
       (l.rstrip("\n").replace("\\n", "\n").split("~") for l in sys.stdin)
       if src.count(old) != 1]
if bad:
    sys.exit("mutant texts not found exactly once:\n" + "\n".join(bad))
' "$src"
# MUTANTS_MATCHING=TEXT runs only the mutants whose name holds TEXT.
if [ -n "${MUTANTS_MATCHING:-}" ]; then
  kept=()
  for m in "${mutants[@]}"; do [[ "${m%%~*}" == *"$MUTANTS_MATCHING"* ]] && kept+=("$m"); done
  mutants=("${kept[@]}")
fi

# The tests that catch a mutant: the attention kernels' own, or the eviction kernels'.
tests_for() {
  if [[ "$1" == decode:* || "$1" == softmax:* || "$1" == sums:* || "$1" == norm:* || "$1" == silu:* || "$1" == rope:* || "$1" == argmax:* ]]; then
    echo "-p keydiff-model --test model_kernels_emulation"
  elif [[ "$1" == sample:* ]]; then
    # The smaller vocabularies' test (the 151,936-value rows take the rest of the binary's time).
    echo "-p keydiff --test sample_emulation sampled_tokens_are_the_host_draws"
  else echo "-p keydiff-cache --test kernel_emulation"; fi
}
cargo test --release -p keydiff-cache --test kernel_emulation --no-run -q 2>/dev/null || true
cargo test --release -p keydiff-model --test model_kernels_emulation --no-run -q 2>/dev/null || true
cargo test --release -p keydiff --test sample_emulation --no-run -q 2>/dev/null || true
survived=0
for m in "${mutants[@]}"; do
  IFS='~' read -r name from to <<< "$m"
  cp "$orig" "$src"
  python3 - "$src" "$from" "$to" <<'PY'
import sys
path, old, new = sys.argv[1], sys.argv[2].replace("\\n", "\n"), sys.argv[3].replace("\\n", "\n")
s = open(path).read()
if s.count(old) != 1:
    sys.exit(f"mutant text found {s.count(old)} times: {old!r}")
open(path, "w").write(s.replace(old, new))
PY
  # shellcheck disable=SC2046  # the package and test, two words each
  if out=$(cargo test --release $(tests_for "$name") 2>&1); then
    echo "SURVIVED  $name"; survived=$((survived + 1))
  else
    failed=$({ grep -E '^test .* FAILED$' || true; } <<< "$out" | sed -E 's/^test (.*) \.\.\. FAILED$/\1/' | tr '\n' ' ')
    # No failing test named: the build failed or the test binary crashed (say which).
    [ -n "$failed" ] || failed=$(grep -m1 -oE 'signal: [0-9]+[^)]*' <<< "$out" ||
      grep -m1 -E '^error' <<< "$out" || echo "?")
    # The emulation's own report (an access onto a guard page), when there is one, else the
    # memory checker's (a race, uninitialised shared memory, an access outside the buffer, the
    # view or the block's head).
    if report=$(grep -m1 -oE 'keydiff emulation: .*' <<< "$out"); then failed="$failed; $report"
    elif report=$(grep -m1 -oE '(data race on [^:]*|[^:]* read before any thread of its block wrote it|`[^`]*` [^:]*: (out of bounds|outside the view)|`[^`]*` byte [0-9]+, in row [0-9]+ of head [0-9]+)' <<< "$out"); then
      failed="$failed; $report"
    fi
    echo "caught    $name  (failed: $failed)"
  fi
done
cp "$orig" "$src"
echo "$((${#mutants[@]} - survived))/${#mutants[@]} mutants caught"
[ "$survived" = 0 ]
