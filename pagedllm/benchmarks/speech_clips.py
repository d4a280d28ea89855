"""Spoken clips for the speech benchmarks: English sentences read by Debian's espeak-ng, 5-10 s each.

The same clips feed ``pagedllm bench transcription`` and the peers in ``benchmarks/whisper_compare.sh``, so every
engine hears the same audio. Nothing is downloaded; the clips are written as 16-bit mono WAV files.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SENTENCES = (
    "The weather is nice today. Please send me the report by Friday, and copy the whole team.",
    "Our train leaves at half past nine, so we should meet at the station no later than nine fifteen.",
    "The committee reviewed the budget and agreed to fund two new projects next spring.",
    "If the printer jams again, open the side panel and pull the paper out slowly.",
    "She planted tomatoes, beans and peppers in the garden behind the old stone house.",
    "The meeting has been moved to Thursday afternoon because the manager is travelling.",
    "Remember to water the plants, feed the cat and lock the back door before you leave.",
    "The museum opens at ten in the morning and the guided tour lasts about one hour.",
    "We measured the temperature every hour and wrote the results in a small notebook.",
    "Please turn left at the second traffic light and park behind the blue building.",
    "The library will be closed on Monday while the new shelves are being installed.",
    "He fixed the bicycle chain, pumped up both tyres and rode to work in the rain.",
    "The soup needs more salt, a little pepper and another ten minutes on the stove.",
    "Our flight was delayed by two hours, so we ate dinner at the airport restaurant.",
    "The children built a tall tower out of wooden blocks and then knocked it down.",
    "Could you check the numbers in the second table before we publish the article tomorrow?",
)


def make_clips(folder: str | Path, count: int = 16) -> list[Path]:
    """Writes ``count`` clips (``clip_00.wav`` ...) into ``folder`` (kept if already there); returns their paths.

    Raises RuntimeError when espeak-ng is not installed.
    """
    if count < 1 or count > len(SENTENCES):
        raise ValueError(f"count: between 1 and {len(SENTENCES)} clips, got {count}")
    if shutil.which("espeak-ng") is None:
        raise RuntimeError("espeak-ng is not installed (apt-get install espeak-ng, or `make speech-tools`)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, sentence in enumerate(SENTENCES[:count]):
        path = folder / f"clip_{i:02d}.wav"
        if not path.exists():
            subprocess.run(["espeak-ng", "-w", str(path), sentence], check=True, capture_output=True, timeout=60)
        paths.append(path)
    return paths
