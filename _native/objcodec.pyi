from typing import Sequence

BLOCK_HEADER_SIZE: int
BATCH_HEADER_SIZE: int
INDEX_ENTRY_SIZE: int
FOOTER_SIZE: int
VERSION: int

class ObjectFormatError(ValueError): ...
class ObjectVersionError(ObjectFormatError): ...

Batch = tuple[int, int, bytes]
Entry = tuple[int, int, int, int, int, int, int]

def encode_object(streams: Sequence[tuple[int, Sequence[Batch]]], block_size: int) -> tuple[bytes, list[Entry]]: ...
def parse_footer(data: bytes | memoryview, object_size: int) -> tuple[int, int, int, int]: ...
def parse_index(data: bytes | memoryview, expected_crc: int) -> list[Entry]: ...
def decode_block(data: bytes | memoryview, offset: int = 0, length: int = 0,
                 expected_stream: int | None = None, batch_type: type | None = None,
                 views: bool = False) -> list[Batch]: ...
