# The engine's native append path (appendpath.pyx): record batches, per-stream writers, the
# append future and the path that ties the WAL ring to the log cache.
from libc.stdint cimport uint32_t, uint64_t, int64_t
from _native.sysdeps cimport pthread_mutex_t

from _native.walring cimport Ring
from _native.logcache cimport LogCache, CacheSlice


cdef class RecordBatch:
    cdef readonly object payload
    cdef readonly uint32_t count
    cdef readonly bint kafka         # a Kafka record batch: the append writes its base offset in


cdef class AppendResult:
    cdef readonly uint64_t base_offset


cdef class AppendFuture:
    cdef readonly uint64_t base_offset
    cdef readonly uint32_t count
    cdef readonly uint64_t wal_end
    cdef readonly int64_t submitted_ns
    cdef AppendPath path
    cdef object error

    cdef object _outcome(self, timeout)


cdef class StreamWriter:
    cdef readonly uint64_t stream_id
    cdef readonly uint64_t epoch
    cdef uint64_t next_off
    cdef uint64_t confirmed
    cdef int wstate
    cdef object failure
    cdef uint64_t failed_at          # base offset of the append that failed the stream
    cdef uint64_t reserved_end       # offsets reserved for this node in metadata end here
    cdef uint64_t reserve_soft       # past this, the reservation is extended ahead of need
    cdef readonly uint64_t tail      # bytes appended here and not yet committed (its un-uploaded tail)
    cdef AppendPath path
    cdef CacheSlice slice
    cdef uint64_t* q_wal             # confirm queue: WAL end of each pending append ...
    cdef uint64_t* q_end             # ... and the stream offset it confirms up to
    cdef size_t q_head
    cdef size_t q_tail
    cdef size_t q_cap

    cdef int _check_open(self) except -1
    cdef int _push_pending(self, uint64_t wal_end, uint64_t end_offset) except -1
    cdef void _advance_confirm(self) noexcept


cdef class AppendPath:
    cdef Ring ring
    cdef LogCache cache
    cdef pthread_mutex_t append_mutex
    cdef bint mutex_ready
    cdef readonly uint64_t max_batch_bytes
    cdef readonly uint64_t admit_limit
    cdef readonly uint64_t uncommitted
    cdef readonly uint64_t pressure_bytes
    cdef readonly uint64_t tail_limit    # most un-uploaded bytes per stream (0: no bound)
    cdef object tail_wait                # (writer, nbytes) -> wait until the writer's tail has room
    cdef bint pressure_signalled
    cdef object refusal              # (error type, message) once the engine takes no appends
    cdef object on_sealed
    cdef object on_pressure
    cdef object admit_wait
    cdef object map_error
    cdef object errors               # dict of error types by role
    cdef object lease_expired        # () -> the exception for an append past the lease
    cdef object reserve              # (writer, end) -> extend the writer's offset reservation
    cdef uint64_t stat_lease_refusals   # appends refused because the lease had run out
    cdef object cb_cond
    cdef list cb_heap
    cdef uint64_t cb_seq
    cdef bint cb_stop
    cdef uint64_t stat_appends
    cdef uint64_t stat_bytes
    cdef uint64_t stat_lock_waits       # appends that found the append lock taken
    cdef int64_t sample_ns[1024]        # submission time of every 64th append (a ring)
    cdef uint64_t sample_end[1024]      # its WAL record's end, to find when it became durable
    cdef uint64_t samples_taken         # samples ever stored
    cdef uint64_t samples_read          # samples ever handed to take_latency_samples

    cdef void _lock_append(self) noexcept
    cdef void _unlock_append(self) noexcept
    cdef AppendFuture _append(self, StreamWriter w, object payload, uint32_t count, bint kafka)
    cdef object _wal_failure(self)
