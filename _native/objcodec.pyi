from typing import Any, Callable, Sequence, TypeVar, overload

BLOCK_HEADER_SIZE: int
BATCH_HEADER_SIZE: int
INDEX_ENTRY_SIZE: int
FOOTER_SIZE: int
VERSION: int

class ObjectFormatError(ValueError): ...
class ObjectVersionError(ObjectFormatError): ...

# Stub-only aliases. A batch to encode: (base_offset, count, payload). An index entry:
# (stream_id, start_offset, end_offset, record_count, block_size, block_position, batch_count).
_Payload = bytes | bytearray | memoryview
_Entry = tuple[int, int, int, int, int, int, int]
_T = TypeVar("_T")

def encode_object(streams: Sequence[tuple[int, Sequence[tuple[int, int, _Payload]]]],
                  block_size: int) -> tuple[bytes, list[_Entry]]: ...
def parse_footer(data: _Payload, object_size: int) -> tuple[int, int, int, int]: ...
def parse_index(data: _Payload, expected_crc: int) -> list[_Entry]: ...
# Payloads are bytes, or memoryview slices of `data` with views=True; batch_type(base_offset,
# count, payload) builds each batch instead of a plain tuple.
@overload
def decode_block(data: _Payload, offset: int = 0, length: int = 0, expected_stream: int | None = None,
                 batch_type: None = None, views: bool = False) -> list[tuple[int, int, bytes | memoryview]]: ...
@overload
def decode_block(data: _Payload, offset: int, length: int, expected_stream: int | None,
                 batch_type: Callable[[int, int, Any], _T], views: bool = False) -> list[_T]: ...
@overload
def decode_block(data: _Payload, offset: int = 0, length: int = 0, expected_stream: int | None = None, *,
                 batch_type: Callable[[int, int, Any], _T], views: bool = False) -> list[_T]: ...
