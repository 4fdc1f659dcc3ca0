"""Lines of the text files users hand us (pretraining documents, record files, tokenizer corpora) as their editors
show them: "\n", "\r\n" and a lone "\r" (old Mac OS, some exporters) each end a line, and a UTF-8 byte order mark
(Windows Notepad, Excel's "UTF-8 CSV") is not text. Other line separators (U+2028, U+0085, form feed) are text:
json.dumps(ensure_ascii=False) leaves them raw inside strings. Torch-free: the record readers and the merge tools
share it."""

from collections.abc import Iterable, Iterator
from typing import NamedTuple

BOM = "\ufeff"
BOM_BYTES = BOM.encode("utf-8")


class ByteLine(NamedTuple):
    """One line of a file, without its line end, and its number (from 1)."""

    number: int
    raw: bytes


def byte_lines(handle: Iterable[bytes]) -> Iterator[ByteLine]:
    """The lines of a file opened in binary, streamed: split at "\n" (by the file's own iteration), then at each lone
    "\r" inside a line; the first line without a byte order mark. Each is undecoded, so a caller can name the line
    that is not UTF-8."""
    number = 0
    for chunk in handle:
        body = chunk[:-1] if chunk.endswith(b"\n") else chunk
        body = body[:-1] if body.endswith(b"\r") else body
        if number == 0 and body.startswith(BOM_BYTES):
            body = body[len(BOM_BYTES):]
        for raw in body.split(b"\r"):
            number += 1
            yield ByteLine(number, raw)


def unified_line_ends(text: str) -> str:
    """text with "\r\n" and lone "\r" line ends as "\n", and no byte order mark in front. For JSON this changes
    nothing a decoder reads: a raw "\r" may stand only between tokens, where it is whitespace like "\n"."""
    text = text[len(BOM):] if text.startswith(BOM) else text
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


def line_at(raw: bytes, offset: int) -> int:
    """The number (from 1) of the line that byte offset of raw lies on, line ends as byte_lines reads them."""
    head = raw[:offset]
    return head.count(b"\n") + head.count(b"\r") - head.count(b"\r\n") + 1
