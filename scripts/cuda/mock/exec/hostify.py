#!/usr/bin/env python3
"""Rewrites a CUDA source so that g++ compiles it for the executing mock (build.sh), where the
nvcc-only parts of candle's runtime-launched kernels (the GGUF matmuls, MMVQ and MMQ) stand:

  - `K<<<grid, block, shared, stream>>>(args)` (host launch code, which the binary's own copy
    runs) becomes `kx_keep(&K)`: the kernel is still instantiated (and exported), nothing is
    launched;
  - `static __global__` / `extern "C" __global__` lose the `static` / `extern "C"`: every
    kernel gets an exported, C++-mangled symbol, whose demangled name gives its parameter
    types (build.sh's index; the binary registers extern "C" kernels by their plain name);
  - `extern __shared__ T name[];` (dynamic shared memory) becomes the launch's buffer;
  - `asm [volatile] ("ptx" : outputs : inputs);` becomes a call to kx_asm (runtime.cpp), which
    runs the warp-collective instructions these kernels use at sm_90 (mma.sync, ldmatrix) over
    the emulation's warp exchange; any other instruction fails the launch there.

Usage: hostify.py SRC DST
       hostify.py --index LIB.so   (kx_runtime.tsv's lines for the library's kernels)
"""
import re
import sys


def match_back(text, i, open_ch, close_ch):
    """text[i] is close_ch: the index of its matching open_ch."""
    depth = 0
    while i >= 0:
        if text[i] == close_ch:
            depth += 1
        elif text[i] == open_ch:
            depth -= 1
            if depth == 0:
                return i
        i -= 1
    raise ValueError(f"unbalanced {close_ch}")


def match_forward(text, i, open_ch, close_ch):
    """text[i] is open_ch: the index just past its matching close_ch (strings skipped)."""
    depth = 0
    while i < len(text):
        c = text[i]
        if c == '"':
            i = text.index('"', i + 1) + 1
            continue
        if c == open_ch:
            depth += 1
        elif c == close_ch:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError(f"unbalanced {open_ch}")


def split_top(s, sep=",", angle=False):
    """Splits s at separators outside (), [], {} (and <> with `angle`: type names) and
    strings."""
    opens, closes = ("([{<", ")]}>") if angle else ("([{", ")]}")
    parts, depth, cur, i = [], 0, [], 0
    while i < len(s):
        c = s[i]
        if c == '"':
            j = s.index('"', i + 1)
            cur.append(s[i:j + 1])
            i = j + 1
            continue
        if c in opens:
            depth += 1
        elif c in closes:
            depth -= 1
        if c == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    parts.append("".join(cur))
    return parts


def newlines(removed):
    """As many line ends as `removed` had (escaped in a macro as there), so that compile errors
    and __LINE__ point at the original lines."""
    escaped = removed.count("\\\n")
    return " \\\n" * escaped + "\n" * (removed.count("\n") - escaped)


def chevrons(text):
    out = text
    while True:
        i = out.find("<<<")
        if i < 0:
            return out
        # The kernel expression before it: an identifier with template arguments and scopes,
        # or a parenthesised expression.
        j = i
        while j > 0 and out[j - 1] in " \t\n\\":
            j -= 1
        start = j
        while start > 0:
            if out[start - 1] == ">":
                start = match_back(out, start - 1, "<", ">")
            elif out[start - 1] == ")":
                start = match_back(out, start - 1, "(", ")")
            k = start
            while k > 0 and (out[k - 1].isalnum() or out[k - 1] in "_:#"):
                k -= 1
            ident = out[k:start]
            start = k
            # Only a scope's template arguments (`A<T>::k`) go on to the left.
            if not (ident.startswith("::") and start > 0 and out[start - 1] == ">"):
                break
        kernel = out[start:j]
        if not kernel.strip():
            raise ValueError("a launch with no kernel before <<<")
        end_cfg = out.index(">>>", i) + 3
        k = end_cfg
        while out[k] in " \t\\\n":
            k += 1
        if out[k] != "(":
            raise ValueError(f"no arguments after the launch of {kernel}")
        end = match_forward(out, k, "(", ")")
        out = out[:start] + f"::kx_keep((const void*)&({kernel}))" + newlines(out[j:end]) + out[end:]


ASM = re.compile(r"\basm\s*(volatile\s*)?\(")


def asm_calls(text):
    out, pos = [], 0
    for m in ASM.finditer(text):
        if m.start() < pos:
            continue
        open_paren = m.end() - 1
        end = match_forward(text, open_paren, "(", ")")
        body = text[open_paren + 1:end - 1]
        # (Inside a macro, the statement's lines end in backslashes.)
        sections = split_top(body.replace("\\\n", " "), ":")
        # The template: adjacent string literals (possibly across lines).
        tmpl = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', sections[0]))
        outs = [o.strip() for o in split_top(sections[1])] if len(sections) > 1 else []
        ins = [o.strip() for o in split_top(sections[2])] if len(sections) > 2 else []
        outs = [o for o in outs if o]
        ins = [o for o in ins if o]

        def operand(o):
            mm = re.match(r'"([^"]*)"\s*\((.*)\)\s*$', o, re.S)
            if not mm:
                raise ValueError(f"asm operand {o!r}")
            return mm.group(1), mm.group(2)

        kinds = "".join(operand(o)[0].lstrip("=+&")[:1] for o in outs)
        o_ptrs = ", ".join(f"(void*)&({operand(o)[1]})" for o in outs)
        i_vals = ", ".join(f"::kx_bits({operand(o)[1]})" for o in ins)
        call = f'kx_asm("{tmpl}", "{kinds}", {{{o_ptrs}}}, {{{i_vals}}}, __FILE__, __LINE__)'
        call += newlines(body)
        out.append(text[pos:m.start()])
        out.append(call)
        pos = end
    out.append(text[pos:])
    return "".join(out)


def hostify(text):
    text = re.sub(r"extern __shared__ ([A-Za-z_0-9]+) ([A-Za-z_0-9]+)\[\];",
                  r"\1* \2 = (\1*)kx_dynamic_shared();", text)
    text = re.sub(r'\bstatic(\s+)__global__', r"\1__global__", text)
    text = re.sub(r'\bextern\s+"C"(\s+)__global__', r"\1__global__", text)
    text = chevrons(text)
    return asm_calls(text)


# Parameter types as runtime.cpp's kx_launch takes them: (kind, bytes).
SCALARS = {
    "bool": ("u", 1), "char": ("i", 1), "signed char": ("i", 1), "unsigned char": ("u", 1),
    "short": ("i", 2), "unsigned short": ("u", 2), "int": ("i", 4), "unsigned int": ("u", 4),
    "long": ("i", 8), "long long": ("i", 8), "unsigned long": ("u", 8),
    "unsigned long long": ("u", 8), "float": ("f", 4), "double": ("d", 8),
    # two-byte structs, integer-class in the x86-64 ABI
    "__half": ("u", 2), "half": ("u", 2), "__nv_bfloat16": ("u", 2),
}


def param_types(demangled):
    """The parameters' (kind, bytes) of a demangled function name, or None if one is not a
    pointer, a reference or a known scalar."""
    if not demangled.endswith(")"):
        return None
    start = match_back(demangled, len(demangled) - 1, "(", ")")
    inner = demangled[start + 1:-1].strip()
    if inner in ("", "void"):
        return []
    out = []
    for p in split_top(inner, angle=True):
        p = re.sub(r"\b(const|volatile|__restrict)\b", "", p).strip()
        p = re.sub(r"\s+", " ", p)
        if p.endswith("*") or p.endswith("&"):
            out.append(("u", 8))
        elif p in SCALARS:
            out.append(SCALARS[p])
        else:
            return None
    return out


def index(lib):
    """kx_runtime.tsv's lines for a library: each exported function under its symbol and, for a
    plain (non-template, unscoped) name, under that name too, which is how the binary registers
    an extern "C" kernel."""
    import subprocess
    nm = subprocess.run(["nm", "-D", "--defined-only", lib], check=True, capture_output=True, text=True)
    syms = [f[2] for f in (l.split() for l in nm.stdout.splitlines())
            if len(f) == 3 and f[1] in "TW" and f[2].startswith("_Z")]
    dem = subprocess.run(["c++filt"], input="\n".join(syms), check=True, capture_output=True,
                         text=True).stdout.splitlines()
    plain = {}
    for sym, d in zip(syms, dem):
        types = param_types(d)
        if types is None:
            continue
        kinds = "".join(k for k, _ in types) or "-"
        sizes = "".join(str(b) for _, b in types) or "-"
        print(f"{sym}\t{sym}\t{kinds}\t{sizes}")
        name = d[:match_back(d, len(d) - 1, "(", ")")]
        if re.fullmatch(r"[A-Za-z_][A-Za-z_0-9]*", name):
            plain.setdefault(name, []).append((sym, kinds, sizes))
    for name, found in sorted(plain.items()):
        if len(found) == 1:  # an overloaded name is no extern "C" kernel's
            sym, kinds, sizes = found[0]
            print(f"{name}\t{sym}\t{kinds}\t{sizes}")


if __name__ == "__main__":
    if sys.argv[1] == "--index":
        index(sys.argv[2])
        sys.exit(0)
    src, dst = sys.argv[1], sys.argv[2]
    with open(src) as f:
        text = f.read()
    with open(dst, "w") as f:
        f.write(hostify(text))
