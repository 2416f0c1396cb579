from typing import Iterator

class Scanner(Iterator[tuple[int, bytes]]):
    stop_reason: int
    end: int
    last_generation: int
    records: int
    record_bytes: int
    paddings: int
    def __init__(self, fd: int, header_area: int, capacity: int, start: int, chunk_size: int = ...) -> None: ...
    def __iter__(self) -> "Scanner": ...
    def __next__(self) -> tuple[int, bytes]: ...

def probe(fd: int, header_area: int, capacity: int, start: int, limit: int, min_generation: int,
          chunk_size: int = ...) -> int: ...
