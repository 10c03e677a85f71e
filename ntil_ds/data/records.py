"""The dataset format: JSONL conversations, read and checked line by line.

One conversation per line, in the `messages` layout of the Hugging Face chat templates:

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "imgs/0.png"},
                                               {"type": "text", "text": "What time is it?"}]},
                  {"role": "assistant", "content": "10:42"}]}

Image paths are relative to the JSONL file's folder (absolute paths work too).
`parse_row` checks a row of any format (ntil_ds/data/sources.py: JSONL, Parquet, Arrow). Text-only lines and several
images per line are allowed. The ShareGPT / LLaVA layout (`conversations` with `from`/`value`, `<image>`
markers in the text and an `image` or `images` key) is converted on reading.

Every problem is a `BadSample` naming the file and line, with a hint on how to fix it.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
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
    source = f"{path}:{number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise BadSample(
            source, "malformed_json", f"not valid JSON ({error}); each line must be one JSON object"
        ) from None
    if not isinstance(row, dict):
        raise BadSample(
            source, "malformed_json", f"expected a JSON object per line, got {type(row).__name__}"
        )
    return parse_row(row, source, path.parent)


def parse_row(row: dict, source: str, folder: Path, embedded: Callable[[tuple], object] | None = None):
    """Check one row (a JSONL line's object, or a Parquet / Arrow row as a dict) and return its
    `Conversation` (raises `BadSample` naming `source`). Image paths are relative to `folder`. An image
    may also be the Hugging Face image struct ``{"bytes": ..., "path": ...}``: its bytes are checked
    here and `embedded(where)` gives the reference kept instead of them (``where``: the keys that lead
    to the struct in the row), so that no image's bytes stay in memory (ntil_ds/data/tables.py)."""

    def bad(reason: str, detail: str) -> BadSample:
        return BadSample(source, reason, detail)

    # a key with null is absent: a table's rows share its columns (a ShareGPT shard has no messages)
    if row.get("messages") is not None:
        messages, image_names = _from_messages(row["messages"], bad, row.get("images"))
    elif row.get("conversations") is not None:
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
    checked = [_checked_image(folder, name, where, bad, embedded) for name, where in image_names]
    return Conversation(
        source=source,
        messages=messages,
        images=[image_path for image_path, _ in checked],
        image_sizes=[size for _, size in checked],
    )


def _from_messages(messages, bad, column=None) -> tuple[list[dict], list[tuple]]:
    """`column`: the row's `images` list, which image parts without a path of their own take in order
    (the layout of TRL / Hugging Face data sets: `{"type": "image"}` parts and an `images` column)."""
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
            for number, part in enumerate(content):
                parts.append(_part(part, ("messages", index, "content", number), bad, image_names))
        else:
            raise bad("bad_schema", f"message {index} content must be a string or a list of parts")
        normalized.append({"role": role, "content": parts})
    pending = [i for i, (name, _) in enumerate(image_names) if name is None]
    if pending or column:
        column = [column] if isinstance(column, dict) else column or []
        if not isinstance(column, list) or len(column) != len(pending):
            raise bad(
                "bad_schema",
                f"{len(pending)} image part(s) without a path but {len(column)} image(s) in 'images'; "
                "give each image part its file ({'type': 'image', 'image': 'x.png'}) or one 'images' entry",
            )
        for number, (i, name) in enumerate(zip(pending, column, strict=True)):
            image_names[i] = (name, ("images", number))
    return normalized, image_names


def _part(part, where: tuple, bad, image_names: list[tuple]) -> dict:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "image":
        keys = [k for k in ("image", "path", "url") if part.get(k)]
        name = part[keys[0]] if keys else None  # None: the row's `images` column holds it
        if name is not None and not isinstance(name, (str, dict)):
            raise bad(
                "bad_schema",
                f"message {where[1]}: image part needs a file path: {{'type': 'image', 'image': 'x.png'}}",
            )
        image_names.append((name, (*where, keys[0]) if keys else None))
        return {"type": "image"}
    raise bad(
        "bad_schema",
        f"message {where[1]}: unsupported content part {part!r}; "
        "use {'type': 'text', 'text': ...} or {'type': 'image', 'image': 'path'}",
    )


def _from_sharegpt(row: dict, bad) -> tuple[list[dict], list[tuple]]:
    """Convert {"conversations": [{"from": "human", "value": "<image>\\n..."}, ...], "image": ...}."""
    key = "images" if row.get("images") is not None else "image"
    image_names = row.get(key)  # ShareGPT has either key, or none (text); a table's column may be null
    if image_names is None:
        image_names = []
    single = isinstance(image_names, (str, dict))
    if single:
        image_names = [image_names]
    if not isinstance(image_names, list) or not all(isinstance(n, (str, dict)) for n in image_names):
        raise bad("bad_schema", "'image' / 'images' must be a path or a list of paths")
    image_names = [(n, (key,) if single else (key, i)) for i, n in enumerate(image_names)]
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


def _checked_image(folder: Path, name, where, bad, embedded) -> tuple[Path | object, tuple[int, int]]:
    if isinstance(name, dict):  # the Hugging Face image struct: its bytes, else its file
        data, path = name.get("bytes"), name.get("path")
        if data is not None:
            if embedded is None or not isinstance(data, (bytes, bytearray)):
                raise bad("bad_schema", "image bytes are read from Parquet / Arrow rows only; give a path")
            try:
                with Image.open(io.BytesIO(data)) as image:
                    width, height = image.size
                    image.verify()
            except Exception as error:  # PIL raises many types for bytes that are not an image
                raise bad(
                    "unreadable_image", f"the bytes of image {path or where} cannot be read ({error})"
                ) from None
            return embedded(where), (height, width)
        if not isinstance(path, str) or not path:
            raise bad("missing_image", "an image struct has neither 'bytes' nor a 'path'")
        name = path
    if not isinstance(name, str) or not name:
        raise bad("missing_image", f"image {where} is empty: give a file path or the image's bytes")
    path = Path(name) if Path(name).is_absolute() else folder / name
    if not path.is_file():
        raise bad(
            "missing_image",
            f"image {name!r} not found (looked at {path}); image paths are relative to the data file's folder",
        )
    try:
        with Image.open(path) as image:
            width, height = image.size
            image.verify()  # reads the file through without decoding pixels: catches truncated files
    except Exception as error:  # PIL raises many types for unreadable files
        raise bad("unreadable_image", f"image {name!r} cannot be read ({error})") from None
    return path, (height, width)


def open_image(image) -> Image.Image:
    """An image of `Conversation.images` opened: a file, or (ntil_ds/data/tables.py) the bytes of a row."""
    return Image.open(image) if isinstance(image, Path) else Image.open(io.BytesIO(image.read_bytes()))
