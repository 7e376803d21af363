"""bench_kernels' ncu child for the ops named in argv[1] (comma-separated)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd() / "benchmarks"))
import bench_kernels as bk  # noqa: E402

bk.NCU_OPS = tuple(sys.argv[1].split(","))
sys.exit(bk.ncu_child("cuda", bk.GPU_SHAPES))
