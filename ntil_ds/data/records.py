"""The dataset format: JSONL conversations, read and checked line by line.

One conversation per line, in the `messages` layout of the Hugging Face chat templates:

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "imgs/0.png"},
                                               {"type": "text", "text": "What time is it?"}]},
                  {"role": "assistant", "content": "10:42"}]}

Image paths are relative to the JSONL file's folder (absolute paths work too). Text-only lines and several
images per line are allowed. The ShareGPT / LLaVA layout (`conversations` with `from`/`value`, `<image>`
markers in the text and an `image` or `images` key) is converted on reading.

Every problem is a `BadSample` naming the file and line, with a hint on how to fix it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
SHAREGPT_IMAGE_MARKER = "<image>"


class DataError(ValueError):
    """The data cannot be used as given (the message says where and how to fix it)."""


class BadSample(DataError):
    """One line of a JSONL file is unusable; `reason` is a short category for the skip report.

    `source` is "file:line"."""

    def __init__(self, source: str, reason: str, detail: str):
        super().__init__(f"{source}: {detail}")
        self.source, self.reason, self.detail = source, reason, detail


@dataclass(frozen=True)
class Conversation:
    """One checked line: messages in the `messages` layout with every content a list of parts.

    Image parts are `{"type": "image"}` in `messages`; their files, in order, are in `images`, and their
    (height, width) in `image_sizes`.
    """

    source: str  # "file:line", for messages about this sample later on
    messages: list[dict]
    images: list[Path]
    image_sizes: list[tuple[int, int]]

    def answers(self) -> list[str]:
        """The assistant answers, in order."""
        return [text_of(m) for m in self.messages if m["role"] == "assistant"]


def text_of(message: dict) -> str:
    """A message's text parts joined (its images left out)."""
    return "".join(part["text"] for part in message["content"] if part["type"] == "text")


def read_jsonl(path: str | Path) -> Iterator[tuple[int, Conversation | BadSample]]:
    """Yield (line number, conversation or the problem with that line) for every non-blank line."""
    for number, _, item in read_jsonl_indexed(path):
        yield number, item


def read_jsonl_indexed(
    path: str | Path, start: int = 0, stop: int | None = None
) -> Iterator[tuple[int, int, Conversation | BadSample]]:
    """Like `read_jsonl`, with each line's byte offset in the file (what the data cache keeps, so that a
    sample's conversation can be read again later without reading the file: `read_conversation_at`).

    `start`, `stop`: only the lines of index [start, stop) (line number = index + 1), what one process of
    a parallel cache build reads (ntil_ds/data/parallel_build.py)."""
    path = require_data_file(path)
    with path.open("rb") as lines:
        offset = _line_offset(lines, start)
        lines.seek(offset)
        for number, raw in enumerate(lines, start=start + 1):
            if stop is not None and number > stop:
                return
            begin, offset = offset, offset + len(raw)
            try:
                line = _decoded(raw, path, number)
                if not line.strip():
                    continue
                yield number, begin, parse_line(line, path, number)
            except BadSample as bad:
                yield number, begin, bad


def _line_offset(file, index: int, chunk_size: int = 1 << 20) -> int:
    """The byte offset where line `index` (0-based) starts: newlines counted a chunk at a time."""
    offset, seen = 0, 0
    while seen < index and (chunk := file.read(chunk_size)):
        count = chunk.count(b"\n")
        if seen + count < index:
            seen, offset = seen + count, offset + len(chunk)
            continue
        position = -1
        for _ in range(index - seen):
            position = chunk.index(b"\n", position + 1)
        return offset + position + 1
    return offset


def require_data_file(path: str | Path) -> Path:
    """`path` as a Path, or a DataError saying what to give when it is not a file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: data file not found (give a JSONL file, one conversation per line)")
    return path


def read_conversation_at(path: str | Path, offset: int, number: int) -> Conversation:
    """The conversation of line `number` that starts at byte `offset` (checked again, images included)."""
    path = Path(path)
    with path.open("rb") as file:
        file.seek(offset)
        return parse_line(_decoded(file.readline(), path, number), path, number)


def _decoded(raw: bytes, path: Path, number: int) -> str:
    # Bytes, not text mode: the byte offset of every line is known (text mode's tell() is opaque), and a
    # line that is not UTF-8 is a bad line of its own rather than an exception that ends the whole file.
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BadSample(f"{path}:{number}", "malformed_json", f"not valid UTF-8 ({error})") from None


def parse_line(line: str, path: Path, number: int) -> Conversation:
    """Parse and check one JSONL line (raises `BadSample`)."""

    def bad(reason: str, detail: str) -> BadSample:
        return BadSample(f"{path}:{number}", reason, detail)

    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise bad("malformed_json", f"not valid JSON ({error}); each line must be one JSON object") from None
    if not isinstance(row, dict):
        raise bad("malformed_json", f"expected a JSON object per line, got {type(row).__name__}")
    if "messages" in row:
        messages, image_names = _from_messages(row["messages"], bad)
    elif "conversations" in row:
        messages, image_names = _from_sharegpt(row, bad)
    else:
        raise bad(
            "bad_schema",
            f"no 'messages' (or ShareGPT 'conversations') key; keys are {sorted(row)}. "
            'Write {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}',
        )

    assistant_turns = [m for m in messages if m["role"] == "assistant"]
    if not assistant_turns:
        raise bad("no_assistant_turn", "conversation has no assistant turn: nothing to train on or score")
    for message in assistant_turns:
        if not text_of(message).strip():
            raise bad("empty_answer", "an assistant answer is empty; give the text the model should produce")
        if any(part["type"] == "image" for part in message["content"]):
            raise bad("bad_schema", "an assistant turn holds an image; images belong in user turns")
    checked = [_checked_image(path.parent, name, bad) for name in image_names]
    return Conversation(
        source=f"{path}:{number}",
        messages=messages,
        images=[image_path for image_path, _ in checked],
        image_sizes=[size for _, size in checked],
    )


def _from_messages(messages, bad) -> tuple[list[dict], list[str]]:
    if not isinstance(messages, list) or not messages:
        raise bad("bad_schema", "'messages' must be a non-empty list of {'role': ..., 'content': ...}")
    normalized, image_names = [], []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise bad("bad_schema", f"message {index} must be an object with 'role' and 'content'")
        role = message["role"]
        if role not in ROLES:
            raise bad("bad_schema", f"message {index} has role {role!r}; use one of {', '.join(ROLES)}")
        content = message["content"]
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            parts = []
            for part in content:
                parts.append(_part(part, index, bad, image_names))
        else:
            raise bad("bad_schema", f"message {index} content must be a string or a list of parts")
        normalized.append({"role": role, "content": parts})
    return normalized, image_names


def _part(part, index: int, bad, image_names: list[str]) -> dict:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "image":
        name = part.get("image") or part.get("path") or part.get("url")
        if not isinstance(name, str) or not name:
            raise bad(
                "bad_schema",
                f"message {index}: image part needs a file path: {{'type': 'image', 'image': 'x.png'}}",
            )
        image_names.append(name)
        return {"type": "image"}
    raise bad(
        "bad_schema",
        f"message {index}: unsupported content part {part!r}; "
        "use {'type': 'text', 'text': ...} or {'type': 'image', 'image': 'path'}",
    )


def _from_sharegpt(row: dict, bad) -> tuple[list[dict], list[str]]:
    """Convert {"conversations": [{"from": "human", "value": "<image>\\n..."}, ...], "image": ...}."""
    image_names = row.get("images", row.get("image", []))  # ShareGPT has either key, or none (text)
    if isinstance(image_names, str):
        image_names = [image_names]
    if not isinstance(image_names, list) or not all(isinstance(n, str) for n in image_names):
        raise bad("bad_schema", "'image' / 'images' must be a path or a list of paths")
    turns = row["conversations"]
    if not isinstance(turns, list) or not turns:
        raise bad("bad_schema", "'conversations' must be a non-empty list of {'from': ..., 'value': ...}")
    messages, markers = [], 0
    for index, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise bad(
                "bad_schema", f"conversations[{index}] must be an object with 'from' and a string 'value'"
            )
        role = SHAREGPT_ROLES.get(turn.get("from"))
        if role is None:
            raise bad(
                "bad_schema",
                f"conversations[{index}] has 'from': {turn.get('from')!r}; use one of {', '.join(SHAREGPT_ROLES)}",
            )
        pieces = turn["value"].split(SHAREGPT_IMAGE_MARKER)
        parts = []
        for piece_index, piece in enumerate(pieces):
            if piece_index > 0:
                parts.append({"type": "image"})
                markers += 1
            text = piece.strip("\n") if len(pieces) > 1 else piece
            if text:
                parts.append({"type": "text", "text": text})
        messages.append({"role": role, "content": parts})
    if markers != len(image_names):
        raise bad(
            "bad_schema",
            f"{len(image_names)} image(s) but {markers} '<image>' marker(s) in the text; "
            "put one '<image>' where each image goes",
        )
    return messages, image_names


def _checked_image(folder: Path, name: str, bad) -> tuple[Path, tuple[int, int]]:
    path = Path(name) if Path(name).is_absolute() else folder / name
    if not path.is_file():
        raise bad(
            "missing_image",
            f"image {name!r} not found (looked at {path}); image paths are relative to the JSONL file's folder",
        )
    try:
        with Image.open(path) as image:
            width, height = image.size
            image.verify()  # reads the file through without decoding pixels: catches truncated files
    except Exception as error:  # PIL raises many types for unreadable files
        raise bad("unreadable_image", f"image {name!r} cannot be read ({error})") from None
    return path, (height, width)
