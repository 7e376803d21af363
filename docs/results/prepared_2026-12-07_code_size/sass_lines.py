"""A kernel's SASS instructions counted by the source line they come from
(the innermost line of `nvdisasm -g -c`'s `//## File` notes), largest
first: where a kernel's code goes, without a GPU.

    nvcc -std=c++17 -O3 -arch=sm_90 -cubin -lineinfo -I csrc csrc/gpu/dispatch.cu -o d.cubin
    nvdisasm -g -c d.cubin > d.sass
    python3 sass_lines.py d.sass dispatch_kernelIlLi8E5uint4Li0E [how many lines]

The second argument is any part of the kernel's mangled name; the text of
each line is read from csrc/ as it is when this runs.
"""
import collections
import re
import sys
from pathlib import Path

NOTE = re.compile(r'\s*//## File "([^"]+)", line (\d+)')
INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]{4,}\*/")


def count_lines(sass: str, kernel: str) -> collections.Counter:
    lines = sass.split("\n")
    start = next(i for i, l in enumerate(lines) if l.startswith("_Z") and kernel in l)
    where, counts = None, collections.Counter()
    for line in lines[start + 1:]:
        if line.startswith("//-----"):  # the next function's section
            break
        note = NOTE.match(line)
        if note:
            where = (note.group(1), int(note.group(2)))
        elif INSTRUCTION.match(line) and where:
            counts[where] += 1
    return counts


def source_text(path: str, line: int) -> str:
    name = Path(path).name
    for d in ("csrc/gpu", "csrc/gpu/device", "csrc"):
        p = Path(d) / name
        if p.exists():
            return p.read_text().split("\n")[line - 1].strip()[:90]
    return ""


def main() -> None:
    counts = count_lines(Path(sys.argv[1]).read_text(), sys.argv[2])
    most = int(sys.argv[3]) if len(sys.argv) > 3 else 25
    print(f"{sum(counts.values())} instructions")
    for (path, line), n in counts.most_common(most):
        print(f"{n:6d}  {Path(path).name}:{line}  {source_text(path, line)}")


if __name__ == "__main__":
    main()
