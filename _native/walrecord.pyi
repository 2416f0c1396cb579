BLOCK: int
HEADER_SLOT: int
HEADER_AREA: int
RECORD_HEADER: int
MAGIC: int
TYPE_DATA: int
TYPE_PADDING: int
STOP_END_OF_SPACE: int
STOP_REASONS: dict[int, str]

def next_record_start(pos: int) -> int: ...
def encode_record(offset: int, generation: int, data: bytes | bytearray | memoryview, rtype: int = ...) -> bytes: ...
def decode_record_header_bytes(data: bytes | bytearray | memoryview) -> tuple[int, int, int, int, int, int]: ...
