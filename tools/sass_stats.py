#!/usr/bin/env python3
"""Instruction mix of one kernel in `cuobjdump --dump-sass` output (reads stdin).

Usage: cuobjdump --dump-sass -arch sm_90 lib.so | python3 tools/sass_stats.py SUBSTRING [OUT]
Prints the opcode histogram of the first function whose mangled name contains SUBSTRING and of
its innermost loop (the span between the last backward branch and its target), and writes the
function's SASS to OUT if given.

For the decode reader (SUBSTRING e.g. decode_mma_kernelILi128ELi2ELi1ELb0) it also prints its step
loop (the shortest loop that holds both an mma and the copies' LDGDEPBAR: full and partial steps
together) and the copies' issue, from the loop's head to that LDGDEPBAR (design notes: "the
copies' lane constants").
"""
import collections
import re
import sys

want = sys.argv[1]
text = sys.stdin.read()
funcs = re.split(r"\n\s+Function : ", text)
body = next((f for f in funcs if want in f.split("\n", 1)[0]), None)
if body is None:
    sys.exit(f"no function matching {want}")
if len(sys.argv) > 2:
    open(sys.argv[2], "w").write(body)
ins = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)([^;]*);", body)
addr = [int(a, 16) for a, _, _, _ in ins]
ops = [op.split(".")[0] for _, _, op, _ in ins]
print(f"{body.split(chr(10), 1)[0][:120]}: {len(ops)} instructions")
print("  all :", collections.Counter(ops).most_common(25))
loops = []
for (a, _, op, rest) in ins:
    m = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
    if m and int(m.group(1), 16) < int(a, 16):
        loops.append((int(m.group(1), 16), int(a, 16)))
if loops:
    lo, hi = max(loops, key=lambda l: l[1] - l[0])
    inner = [o for x, o in zip(addr, ops) if lo <= x <= hi]
    print(f"  loop 0x{lo:x}..0x{hi:x}: {len(inner)} instructions")
    print("  loop:", collections.Counter(inner).most_common(25))
steps = []
for (a, _, op, rest) in ins:
    m = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
    if m and int(m.group(1), 16) < int(a, 16):
        lo, hi = int(m.group(1), 16), int(a, 16)
        span = [o for x, o in zip(addr, ops) if lo <= x <= hi]
        if "HMMA" in span and "LDGDEPBAR" in span[1:]:
            steps.append((len(span), lo, hi, span))
if steps:
    n, lo, hi, span = min(steps)
    print(f"  step loop 0x{lo:x}..0x{hi:x}: {n} instructions; issue (head to LDGDEPBAR): {span.index('LDGDEPBAR') + 1}")
