from typing import Any, Callable, Sequence

HEADER_SIZE: int

# Stub-only aliases. A batch's header fields and records, as decode_batch returns them:
# (base_offset, batch_length, partition_leader_epoch, crc, attributes, last_offset_delta,
# base_timestamp, max_timestamp, producer_id, producer_epoch, base_sequence, records).
_Buffer = bytes | bytearray | memoryview
_Decoded = tuple[int, int, int, int, int, int, int, int, int, int, int, list[Any]]

def set_error_types(**types: type[Exception]) -> None: ...
def set_record_types(record: type, consumed: type[tuple[Any, ...]]) -> None: ...
def encode_batch(records: Sequence[Any], now_ms: int, base_offset: int, attributes: int, partition_leader_epoch: int,
                 producer_id: int, producer_epoch: int, base_sequence: int,
                 compress: Callable[[int, bytes], Any]) -> bytes: ...
def decode_batch(buf: _Buffer, at: int, whole: bool, partial_ok: bool,
                 decompress: Callable[[int, memoryview, int, int], Any], max_decompressed: int) -> _Decoded | None: ...
