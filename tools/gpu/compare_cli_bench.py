# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Puts `fastcomms bench --json` (the console script) beside the C++ bench_a2a table of the same
run, shape by shape: the CLI's zero-copy auto-engine call against bench_a2a's zero-copy SM (sm0)
and copy-engine (ce0) columns, and the CLI's permute path against bench_a2a's nccl+perm. A report
for scripts/gpu.sh (issue 17 asks the two to agree within 10%); it prints, it does not judge.
Usage: python3 tools/gpu/compare_cli_bench.py CLI.json bench_a2a.log"""

import json
import re
import sys


def a2a_rows(text):
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^\((\d+),(\d+),(\d+),(\d+)\)\s+[\d.]+ \|([^|]+)\|([^|]+)\|", line)
        if m:
            first = [float(v) for v in m.group(5).split()]
            second = [float(v) for v in m.group(6).split()]
            rows[tuple(int(m.group(i)) for i in range(1, 5))] = {
                "ce0": first[2],
                "sm0": first[3],
                "nccl+perm": second[0],
            }
    return rows


def main():
    cli = json.load(open(sys.argv[1]))
    a2a = a2a_rows(open(sys.argv[2]).read())
    print(f"CLI ({cli['backend']}: {cli['transport']}) against bench_a2a, µs per call")
    print(
        f"{'shape':22s} {'CLI ours':>9s} {'a2a sm0':>8s} {'a2a ce0':>8s} {'ours/sm0':>9s} "
        f"{'CLI perm':>9s} {'a2a nccl+perm':>14s} {'perm/perm':>10s} {'CLI host ours':>14s}"
    )
    for row in cli["rows"]:
        shape = tuple(row["shape"])
        ref = a2a.get(shape)
        if ref is None:
            print(f"{str(shape):22s} {row['ours_us']:9.1f}   (no bench_a2a row)")
            continue
        print(
            f"{str(shape):22s} {row['ours_us']:9.1f} {ref['sm0']:8.1f} {ref['ce0']:8.1f} "
            f"{row['ours_us'] / ref['sm0']:8.2f}x {row['permute_us']:9.1f} "
            f"{ref['nccl+perm']:14.1f} {row['permute_us'] / ref['nccl+perm']:9.2f}x "
            f"{row.get('ours_host_us', float('nan')):14.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
