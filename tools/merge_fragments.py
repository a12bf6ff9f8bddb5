#!/usr/bin/env python3
"""Copies section files into the single-file headers between '// @section FILE begin/end' markers.
Used while a section is developed in its own file; the headers stay the single source users get."""
import re, sys, pathlib
root = pathlib.Path(__file__).resolve().parent.parent
for header in ["tsys.h", "tsys_cuda.cuh"]:
    p = root / header
    if not p.exists(): continue
    text = p.read_text()
    def fill(m):
        frag = (root / m.group(1)).read_text().rstrip("\n") + "\n"
        return m.group(0).split("\n", 1)[0] + "\n" + frag + m.group(3)
    new = re.sub(r"// @section (\S+) begin\n(.*?)(// @section \1 end)", fill, text, flags=re.S)
    if new != text:
        p.write_text(new); print("updated", header)
