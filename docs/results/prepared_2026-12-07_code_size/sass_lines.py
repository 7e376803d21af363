"""A kernel's SASS instructions counted by the source line they come from,
largest first: where a kernel's code goes, without a GPU. The SASS is read
by benchmarks/ncu_stalls.py's `read_sass_lines`; run from the repository
root.

    nvcc -std=c++17 -O3 -arch=sm_90 -cubin -lineinfo -I csrc csrc/gpu/dispatch.cu -o d.cubin
    nvdisasm -g -c d.cubin > d.sass
    python3 docs/results/prepared_2026-12-07_code_size/sass_lines.py d.sass dispatch_kernelIlLi8E5uint4Li0E [how many lines]

The second argument is any part of the kernel's mangled name; each line's
text is read from the file the SASS names, as it is when this runs.
"""
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd() / "benchmarks"))
from ncu_stalls import read_sass_lines, source_text  # noqa: E402


def main() -> None:
    functions = read_sass_lines(Path(sys.argv[1]))
    name = next(n for n in functions if sys.argv[2] in n)
    counts = collections.Counter(functions[name][1])
    most = int(sys.argv[3]) if len(sys.argv) > 3 else 25
    print(f"{sum(counts.values())} instructions")
    for where, n in counts.most_common(most):
        print(f"{n:6d}  {Path(where).name}  {source_text(where)[:90]}")


if __name__ == "__main__":
    main()
