"""The native core's figures with ratios against in-process baselines (issue: native core).

    .venv/bin/python bench/native_core.py [--keys 1000000]

Runs the allocator figures (bench/native_alloc.py) and the radix-tree figures
(bench/native_art.py) in this one process and prints each with its baseline ratio.
"""
import argparse
import os
import sys


def main(argv=None) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import native_alloc
    import native_art

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=1_000_000, help="radix-tree keys (default 1M)")
    args = parser.parse_args(argv)
    print("# offset allocator")
    native_alloc.main([])
    print()
    print("# adaptive radix tree")
    native_art.main(["--keys", str(args.keys)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
