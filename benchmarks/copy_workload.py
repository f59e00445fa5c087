"""A copy-heavy chat workload: each request hands the model a passage (plain English prose or small Python functions,
roughly 150-400 tokens) and asks it to repeat the passage verbatim, to rewrite it with one small edit (a word
replaced, a variable renamed), or to copy out some of its sentences or one of its functions. Most output tokens then
already occur in the prompt, which is where draft-free speculative decoding (n-gram / prompt-lookup drafts) pays off;
random-token or ShareGPT-shaped workloads hide that gain. Same seed, same requests; nothing is downloaded.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("repeat", "edit", "extract")
PASSAGE_TOKENS = (150, 340)  # drawn target; the last whole item added may overshoot it by up to ~60 tokens
# SmolLM2's tokenizer on these pools: about 5.0 characters per token of prose, 3.5 of code
CHARS_PER_TOKEN = {False: 5.0, True: 3.5}

SENTENCES = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling after decades of salt and wind.",
    "Every morning the baker opened the shop at six and set the first loaves of bread on the wooden shelves.",
    "A small river ran through the village, and children liked to race paper boats along its gentle current.",
    "The library kept its rarest maps in a cool room at the back, where visitors had to wear cotton gloves.",
    "When the train was late, the passengers gathered near the heater and talked about the coming storm.",
    "Her garden was famous for its roses, which bloomed in six different colors from June until September.",
    "The committee agreed to meet again next Tuesday to review the budget and choose a new project manager.",
    "Most bicycles in the city were painted blue, because the factory that built them only made one color.",
    "At the top of the hill there was a bench with a view of the harbor and the islands beyond it.",
    "The museum opened a new exhibit about ancient clocks, showing how people measured time with water and sand.",
    "He wrote a letter to his grandmother every Sunday and always ended it with a short drawing of a cat.",
    "The weather report warned of heavy rain in the afternoon, so the farmers brought the hay inside early.",
    "Our team tested the new software for three weeks before we were confident enough to release it.",
    "The mountain path was narrow and steep, but the hikers reached the summit just before sunset.",
    "In the evening the market square filled with musicians, food stalls and families walking slowly.",
    "The teacher asked each student to bring one stone from home and describe where it had been found.",
    "A thick fog rolled in from the sea, and the fishing boats waited in the harbor until it lifted.",
    "The recipe calls for two cups of flour, one egg, a pinch of salt and a spoon of melted butter.",
    "Scientists at the station measured the temperature of the lake every hour for an entire year.",
    "The new bridge shortened the trip to the city by twenty minutes and brought more visitors to the town.",
    "On rainy days the cat slept on the windowsill and watched the drops run down the glass.",
    "The company moved its office to a larger building with a garden on the roof and a quiet reading room.",
    "Each chapter of the book begins with a short poem that hints at what will happen next.",
    "The orchestra practiced the final movement again and again until every note sounded clear and bright.",
)

# (code, a name in it that an "edit" request renames, the function an "extract" request copies)
SNIPPETS = (
    ("def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
     "    return total / len(values)\n", "total", "mean"),
    ("def word_counts(text):\n    counts = {}\n    for word in text.lower().split():\n"
     "        counts[word] = counts.get(word, 0) + 1\n    return counts\n", "counts", "word_counts"),
    ("def clamp(number, low, high):\n    if number < low:\n        return low\n    if number > high:\n"
     "        return high\n    return number\n", "number", "clamp"),
    ("def read_lines(path):\n    with open(path) as handle:\n"
     "        return [line.rstrip('\\n') for line in handle if line.strip()]\n", "handle", "read_lines"),
    ("def fibonacci(limit):\n    sequence = [0, 1]\n    while sequence[-1] + sequence[-2] < limit:\n"
     "        sequence.append(sequence[-1] + sequence[-2])\n    return sequence\n", "sequence", "fibonacci"),
    ("def is_palindrome(phrase):\n    letters = [c.lower() for c in phrase if c.isalnum()]\n"
     "    return letters == letters[::-1]\n", "letters", "is_palindrome"),
    ("def merge_sorted(left, right):\n    result = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n"
     "        if left[i] <= right[j]:\n            result.append(left[i])\n            i += 1\n        else:\n"
     "            result.append(right[j])\n            j += 1\n    return result + left[i:] + right[j:]\n",
     "result", "merge_sorted"),
    ("def chunked(items, size):\n    batches = []\n    for start in range(0, len(items), size):\n"
     "        batches.append(items[start:start + size])\n    return batches\n", "batches", "chunked"),
    ("def celsius_to_fahrenheit(degrees):\n    return degrees * 9 / 5 + 32\n", "degrees", "celsius_to_fahrenheit"),
    ("class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self, step=1):\n"
     "        self.count += step\n        return self.count\n", "step", "increment"),
    ("def flatten(nested):\n    flat = []\n    for group in nested:\n        flat.extend(group)\n    return flat\n",
     "flat", "flatten"),
)

# New words for prose edits. Any word of the passage may be swapped for one: the request is there to make the model
# copy everything around the edit, so the sentence need not make sense afterwards.
REPLACEMENTS = ("garden", "window", "harbor", "teacher", "bridge", "letter", "station", "market")


@dataclass(frozen=True, slots=True)
class CopyRequest:
    """One chat request of the workload; `kind` (repeat, edit or extract) says what it asks for."""
    messages: list[dict[str, str]]
    max_tokens: int
    kind: str


@dataclass(frozen=True, slots=True)
class Passage:
    """A drawn passage, and what an instruction about it may name."""
    text: str
    is_code: bool
    parts: tuple[str, ...]  # the sentences, or the snippets' function names, in passage order
    renamable: tuple[str, ...]  # code: names an edit may rename; prose: empty (words come from the text)


def _passage(rng: random.Random) -> Passage:
    """Prose or code, whole items drawn without repeats until the estimated length reaches a drawn target."""
    is_code = rng.random() < 0.5
    target_chars = rng.randint(*PASSAGE_TOKENS) * CHARS_PER_TOKEN[is_code]
    pool = list(SNIPPETS if is_code else SENTENCES)
    rng.shuffle(pool)
    chosen, length = [], 0
    for item in pool:
        chosen.append(item)
        length += len(item[0] if is_code else item)
        if length >= target_chars:
            break
    if is_code:
        return Passage("\n".join(code for code, _, _ in chosen), True, tuple(fn for _, _, fn in chosen),
                       tuple(name for _, name, _ in chosen))
    return Passage(" ".join(chosen), False, tuple(chosen), ())


def _instruction(rng: random.Random, kind: str, passage: Passage) -> str:
    what = "code" if passage.is_code else "text"
    if kind == "repeat":
        return f"Repeat the following {what} exactly, word for word, with no changes and no comments."
    if kind == "edit" and passage.is_code:
        old = rng.choice(passage.renamable)
        return (f"Rewrite the following code exactly as it is, except rename the variable `{old}` to "
                f"`{old}_value` everywhere. Output only the code.")
    if kind == "edit":
        # A longish word that really occurs, so the edit changes the output and the rest is copied unchanged.
        words = sorted({w for w in (t.strip(".,") for t in passage.text.split()) if len(w) >= 6 and w.isalpha()})
        old = rng.choice(words)
        return (f"Rewrite the following text exactly as it is, except replace the word '{old}' with "
                f"'{rng.choice(REPLACEMENTS)}'. Output only the rewritten text.")
    if passage.is_code:
        return f"Copy the function `{rng.choice(passage.parts)}` from the following code exactly, and nothing else."
    first = rng.randint(1, max(1, len(passage.parts) - 2))
    last = min(len(passage.parts), first + rng.randint(1, 3))
    return f"Copy sentences {first} to {last} of the following text exactly, one per line, and nothing else."


def copy_requests(num: int, seed: int, max_tokens: int) -> list[CopyRequest]:
    """`num` requests, kinds in rotation (a third each), passages and details drawn from `seed` alone."""
    if num < 0 or max_tokens < 1:
        raise ValueError(f"need num >= 0 and max_tokens >= 1, got {num} and {max_tokens}")
    rng = random.Random(seed)  # a private generator: callers' and other modules' random state stay untouched
    requests = []
    for i in range(num):
        kind = KINDS[i % len(KINDS)]
        passage = _passage(rng)
        body = f"```python\n{passage.text}```" if passage.is_code else passage.text
        content = f"{_instruction(rng, kind, passage)}\n\n{body}"
        requests.append(CopyRequest([{"role": "user", "content": content}], max_tokens, kind))
    return requests
