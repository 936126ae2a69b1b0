#!/usr/bin/env python3
"""Read TensorBoard event files with TensorBoard's own reader and print their scalars.

Checks that Ferrotron's event files (crates/ferrotron-train/src/metrics/tensorboard.rs) are
what TensorBoard reads: `tensorboard.backend.event_processing.event_accumulator` loads every
`events.out.tfevents.*` file under PATH (a file or a run directory) and this prints, per tag,
each (step, value). Exit status 1 when no scalar was read or an expected tag is missing.

Usage (pinned venv: bash tools/setup_venv.sh):
    FERROTRON_METRICS_OUT=/tmp/tb cargo test -p ferrotron-train --test metrics
    tools/.venv/bin/python tools/check_tfevents.py /tmp/tb/tensorboard \
        --expect "lm loss" "lm loss validation"
"""

import argparse
import sys

from tensorboard.backend.event_processing import event_accumulator


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="an event file or a directory holding event files")
    ap.add_argument("--expect", nargs="*", default=[], help="tags that must be present")
    args = ap.parse_args()

    # size_guidance 0 = keep every scalar (the default samples down to 10,000 per tag).
    acc = event_accumulator.EventAccumulator(
        args.path, size_guidance={event_accumulator.SCALARS: 0}
    )
    acc.Reload()
    tags = acc.Tags()["scalars"]
    print(f"file_version: {acc.file_version}")
    for tag in tags:
        events = acc.Scalars(tag)
        points = ", ".join(f"({e.step}, {e.value:.6g})" for e in events)
        print(f"{tag!r}: {len(events)} points: {points}")
    missing = [t for t in args.expect if t not in tags]
    if not tags or missing:
        print(f"error: {args.path}: no scalars" if not tags else f"error: missing tags {missing}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
