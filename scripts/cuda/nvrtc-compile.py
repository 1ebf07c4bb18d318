#!/usr/bin/env python3
"""Compiles a CUDA source to PTX with a given NVRTC library (the front end nvcc uses, as a
library), for the older-toolkit compile check (scripts/cuda/older-toolkits.sh).

Usage: nvrtc-compile.py LIBNVRTC ARCH OUT.ptx SOURCE.cu [-I DIR]...
Fails (exit 1) on an error or on any warning, printing NVRTC's log.
"""
import ctypes
import sys


def main() -> int:
    lib, arch, out, src, *includes = sys.argv[1:]
    nvrtc = ctypes.CDLL(lib)
    prog = ctypes.c_void_p()
    code = open(src, "rb").read()
    name = src.rsplit("/", 1)[-1].encode()
    rc = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), code, name, 0, None, None)
    if rc != 0:
        print(f"nvrtcCreateProgram: error {rc}", file=sys.stderr)
        return 1
    # What keydiff-kernels' build.rs gives nvcc: C++17, the PTX of one architecture.
    opts = [f"--gpu-architecture=compute_{arch}", "-std=c++17"] + includes
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    text = log.value.decode(errors="replace").strip()
    if text:
        print(text, file=sys.stderr)
    if rc != 0:
        print(f"{src}: NVRTC failed (error {rc})", file=sys.stderr)
        return 1
    if "warning" in text:
        print(f"{src}: NVRTC warned (warnings are errors, as with nvcc)", file=sys.stderr)
        return 1
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    with open(out, "wb") as f:
        f.write(ptx.value)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return 0


if __name__ == "__main__":
    sys.exit(main())
