"""The command form: `e31 submit --workdir . -- python train.py --epochs 3`.

A stand-in for a training script: it reads its data from the bundle, "trains" for the epochs
asked, and leaves a result in $E31_OUTPUT_DIR.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from pathlib import Path

from textstats import top_words


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    words = Path("data/words.txt").read_text().split()
    for epoch in range(1, args.epochs + 1):
        print(f"epoch {epoch}/{args.epochs}: {len(words)} words seen")
    result = {"epochs": args.epochs, "top": top_words(Counter(words), 1)}
    Path(os.environ["E31_OUTPUT_DIR"], "train.json").write_text(json.dumps(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
