#!/usr/bin/env python3
"""The order of the instructions that shape a Hopper kernel's wgmma pipeline, read from an sm_90a cubin without a
disassembler (the CPU machine has none; cuobjdump is on the GPU machine only). Per kernel, runs of: HGMMA (wgmma),
ARRIVE (warpgroup.arrive), DEPBAR (wgmma.wait_group), MUFU (exp2), F2FP (packing to 16 bits), FMUL, SHFL, SYNCS
(mbarrier), BAR, STS, with the byte offset of each run's first instruction; branches are left out. The class is
the low 9 bits of each 128-bit instruction's first word, checked against cuobjdump -sass of the same kernels
(CUDA 13.0): it is not a disassembler and knows only these classes.

  nvcc -std=c++17 -O3 -cubin -gencode arch=compute_90a,code=sm_90a -DFUSEDATTN_WITH_CUDA=1 -Iinclude \\
       -I/usr/include/eigen3 -o k.cubin probe.cu    # probe.cu: explicit instantiations of the kernels
  bench/gpu/sass_order.py k.cubin [substring of the mangled kernel name]

It shows where ptxas puts the wait for P_{j-1}·V_{j-1} relative to the softmax's exponentials (docs/design.md)."""
import struct
import sys

CLASSES = {0x1F0: "HGMMA", 0x1C5: "WG", 0x108: "MUFU", 0x189: "SHFL", 0x1A7: "SYNCS", 0x03E: "F2FP", 0x11D: "BAR",
           0x188: "STS", 0x020: "FMUL"}


def sections(path):
    """(name, bytes) of each section of an ELF64 little-endian file."""
    data = open(path, "rb").read()
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]
    for h in headers:
        name = data[names + h[0]: data.index(b"\0", names + h[0])].decode()
        yield name, data[h[4]: h[4] + h[5]]


def runs(code):
    """[offset, class, count] runs of the classes above, in program order."""
    out = []
    for off in range(0, len(code) - 15, 16):
        (word,) = struct.unpack_from("<Q", code, off)
        cls = CLASSES.get(word & 0x1FF)
        if cls == "WG":  # warpgroup.arrive and wgmma.wait_group share the opcode; bit 47 marks the wait
            cls = "DEPBAR" if word >> 47 & 1 else "ARRIVE"
        if cls is None:
            continue
        if out and out[-1][1] == cls:
            out[-1][2] += 1
        else:
            out.append([off, cls, 1])
    return out


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    pattern = sys.argv[2] if len(sys.argv) > 2 else ""
    for name, code in sections(sys.argv[1]):
        if not name.startswith(".text.") or pattern not in name:
            continue
        print(f"== {name[6:]} ({len(code) // 16} instructions)")
        print(" ".join(f"{c}x{k}@{o:x}" if k > 1 else f"{c}@{o:x}" for o, c, k in runs(code)))


if __name__ == "__main__":
    main()
