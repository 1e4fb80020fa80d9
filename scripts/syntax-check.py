#!/usr/bin/env python3
"""Compiles every C++ translation unit of a CMake build once more under another language standard, front end only.

Reads the build's compile_commands.json (CMAKE_EXPORT_COMPILE_COMMANDS), and runs each C++ entry's own command with
its -std= replaced by the one asked for and -fsyntax-only (parsing and every template instantiation the unit needs,
no code generation), in parallel. CUDA entries are left out. scripts/run-tests.sh stage 2 uses it for C++20:

    python3 scripts/syntax-check.py build/ci-release/compile_commands.json --std 20 -j 2

Prints the compiler's messages for every unit that has any, and exits 1 when a unit fails to compile.
"""
import argparse
import concurrent.futures
import json
import re
import shlex
import subprocess
import sys

CXX_SUFFIXES = (".cpp", ".cc", ".cxx", ".C")
# Options that name an output or a dependency file (the value is the next argument), and ones that make one.
DROP_WITH_VALUE = {"-o", "-MF", "-MT", "-MQ"}
DROP_ALONE = {"-c", "-MD", "-MMD"}


def syntax_command(args, std):
    """The compile command `args` without outputs, with -std=<gnu++|c++><std> and -fsyntax-only."""
    out, skip = [], False
    had_std = False
    for a in args:
        if skip:
            skip = False
            continue
        if a in DROP_WITH_VALUE:
            skip = True
            continue
        if a in DROP_ALONE:
            continue
        m = re.fullmatch(r"-std=(gnu\+\+|c\+\+)\w+", a)
        if m:
            a = f"-std={m.group(1)}{std}"
            had_std = True
        out.append(a)
    if not had_std:
        out.insert(1, f"-std=c++{std}")
    return out + ["-fsyntax-only"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("compile_commands")
    ap.add_argument("--std", default="20", help="the standard's number: 17, 20, 23 (default 20)")
    ap.add_argument("-j", "--jobs", type=int, default=1)
    opts = ap.parse_args()

    with open(opts.compile_commands, encoding="utf-8") as f:
        entries = json.load(f)
    units, seen = [], set()
    for e in entries:
        if not e["file"].endswith(CXX_SUFFIXES):
            continue
        args = e["arguments"] if "arguments" in e else shlex.split(e["command"])
        if "nvcc" in args[0]:
            continue
        cmd = syntax_command(args, opts.std)
        key = (e["directory"], tuple(cmd))
        if key not in seen:  # the same file with the same flags in two targets is checked once
            seen.add(key)
            units.append((e["file"], e["directory"], cmd))
    if not units:
        print(f"syntax-check: no C++ translation unit in {opts.compile_commands}")
        return 1

    def run(unit):
        file, directory, cmd = unit
        r = subprocess.run(cmd, cwd=directory, capture_output=True, text=True)
        return file, r.returncode, r.stdout + r.stderr

    failed = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, opts.jobs)) as pool:
        for file, rc, text in pool.map(run, units):
            if text.strip():
                print(f"--- {file} (C++{opts.std}, exit {rc})\n{text}", end="" if text.endswith("\n") else "\n")
            if rc != 0:
                failed.append(file)
    if failed:
        print(f"syntax-check: {len(failed)} of {len(units)} translation units do not compile as C++{opts.std}:")
        for file in failed:
            print(f"  {file}")
        return 1
    print(f"syntax-check: {len(units)} translation units compile as C++{opts.std}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
