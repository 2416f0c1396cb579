from typing import Any

def encode_columns(v_valid: Any, v_offsets: Any, v_data: Any, v_at: int,
                   k_valid: Any, k_offsets: Any, k_data: Any, k_at: int,
                   t_valid: Any, t_values: Any, t_at: int, t_per_ms: int,
                   n: int, now_ms: int, max_records: int, max_bytes: int) -> list[tuple[bytes, int]]: ...
