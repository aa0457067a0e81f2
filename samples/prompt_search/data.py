"""Short product and film reviews, each labelled ``positive`` or ``negative``: 24 to train on
(the runs APO's critiques quote) and 24 held out (the runs that score a template). Written for
this sample; balanced in each split."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

LABELS = ("positive", "negative")

TRAIN = [
    ("The battery lasts all day and the screen is gorgeous.", "positive"),
    ("It stopped working after two days. Waste of money.", "negative"),
    ("A warm, funny film with a cast that clearly loved making it.", "positive"),
    ("The plot made no sense and the ending was lazy.", "negative"),
    ("Fast delivery, well packed, and it works exactly as described.", "positive"),
    ("The zipper broke the first time I used it.", "negative"),
    ("I laughed from start to finish. Highly recommended.", "positive"),
    ("Two hours of my life I will never get back.", "negative"),
    ("Comfortable, sturdy, and it looks even better than the photos.", "positive"),
    ("The instructions were useless and two screws were missing.", "negative"),
    ("Beautifully shot, and the music gave me chills.", "positive"),
    ("The sound cuts out every few minutes. Very disappointing.", "negative"),
    ("My kids love it and ask to play with it every day.", "positive"),
    ("Boring, slow and far too long.", "negative"),
    ("Great value for the price; I bought a second one for my sister.", "positive"),
    ("The colour faded after one wash.", "negative"),
    ("The best thriller I have seen in years.", "positive"),
    ("Customer service never answered my emails.", "negative"),
    ("Light, quiet and powerful: everything I wanted in a vacuum.", "positive"),
    ("The acting was wooden and the jokes fell flat.", "negative"),
    ("It arrived early and set up in five minutes.", "positive"),
    ("Cheap plastic that cracked within a week.", "negative"),
    ("A moving story that stayed with me for days.", "positive"),
    ("Overpriced and it smells strange.", "negative"),
]

VAL = [
    ("Works perfectly and the battery charges quickly.", "positive"),
    ("It broke on the first day and the seller refused a refund.", "negative"),
    ("A delightful film for the whole family.", "positive"),
    ("The story dragged on and I fell asleep halfway through.", "negative"),
    ("Soft, warm and well made. I love this blanket.", "positive"),
    ("The lid does not close properly and it leaks everywhere.", "negative"),
    ("Brilliant performances and a clever script.", "positive"),
    ("Terrible picture quality, nothing like the advert.", "negative"),
    ("Exactly what I needed for my small kitchen.", "positive"),
    ("The app crashes every time I open it.", "negative"),
    ("An exciting adventure with stunning visuals.", "positive"),
    ("The shoes hurt my feet after ten minutes.", "negative"),
    ("Sturdy, simple and it does the job well.", "positive"),
    ("A dull remake that adds nothing to the original.", "negative"),
    ("My new favourite headphones: clear sound and very comfortable.", "positive"),
    ("Arrived damaged and half the parts were missing.", "negative"),
    ("The ending made me cry in the best way.", "positive"),
    ("Far too loud and it vibrates across the table.", "negative"),
    ("I use it every morning and it still works like new.", "positive"),
    ("The characters were flat and the dialogue was awful.", "negative"),
    ("Good quality for the price and it shipped fast.", "positive"),
    ("It stopped charging after a month.", "negative"),
    ("Charming, clever and beautifully acted.", "positive"),
    ("Flimsy and much smaller than I expected.", "negative"),
]


def rows(split: str = "train") -> list[dict[str, Any]]:
    """The rows of ``split`` (``train`` or ``val``): ``{"text": ..., "label": ...}``."""
    pairs = {"train": TRAIN, "val": VAL}[split]
    return [{"text": text, "label": label} for text, label in pairs]


def write(folder: Path) -> tuple[Path, Path]:
    """Write the splits as ``folder/train.jsonl`` and ``folder/val.jsonl`` (what a ``voltrl
    train`` config names: ``prompt_and_weights.yaml``); returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for split in ("train", "val"):
        path = folder / f"{split}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows(split)))
        paths.append(path)
    return paths[0], paths[1]


if __name__ == "__main__":  # python samples/prompt_search/data.py [FOLDER]
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/prompt-search-data")
    print("wrote", *write(folder))
