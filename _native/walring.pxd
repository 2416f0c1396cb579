# Declarations of the WAL ring (walring.pyx): its batch slots, the append handle and the Ring,
# so that the engine's native append path (appendpath.pyx) places records without a Python call.
from libc.stdint cimport uint32_t, uint64_t, int64_t

from _native.sysdeps cimport pthread_mutex_t, pthread_cond_t


cdef struct Batch:
    unsigned char* buf
    size_t buf_size
    uint64_t start        # logical offset of buf[0], 4 KiB aligned
    uint64_t pos          # logical offset just past the last record placed
    uint64_t data_end     # end of the last data record, 0 if none (padding-only batch)
    size_t write_len      # bytes to write, set when sealed
    uint32_t records
    int state
    int error             # errno of a failed write


cdef class AppendHandle:
    cdef readonly uint64_t offset
    cdef readonly uint64_t end
    cdef readonly int64_t submitted_ns
    cdef Ring ring


cdef class Ring:
    cdef int fd
    cdef uint64_t header_area
    cdef readonly uint64_t capacity
    cdef size_t batch_size
    cdef readonly size_t max_record
    cdef readonly uint32_t generation
    cdef int nbatches
    cdef Batch* batches
    cdef uint64_t open_seq
    cdef uint64_t write_seq
    cdef uint64_t done_seq
    cdef uint64_t failed_seq
    cdef bint has_open
    cdef uint64_t next_offset
    cdef uint64_t _trim_offset
    cdef uint64_t _fill_end             # records end at or before it (first zero-fill); max once filled
    cdef uint64_t _durable_end
    cdef uint64_t _acked_end             # acknowledged: durable while the ack deadline held
    cdef readonly int64_t ack_deadline_ns    # CLOCK_MONOTONIC; no acknowledgment at or after it
    cdef bint revoked                    # acknowledgments revoked for good (set_ack_deadline never again)
    cdef object revoked_error
    cdef uint64_t stat_held_advances     # durable advances not acknowledged (the deadline had passed)
    cdef uint64_t _appended_end
    cdef unsigned char* resume_block
    cdef int io_errno
    cdef object external_error           # an external writer's failure (finish_batch)
    cdef int64_t last_take_ns            # when an external writer last took a batch
    cdef bint stopping
    cdef bint dispatch_stop
    cdef int idle_writers
    cdef int64_t full_timeout_ns
    cdef pthread_mutex_t mutex
    cdef pthread_cond_t work_cv
    cdef pthread_cond_t space_cv
    cdef pthread_cond_t done_cv          # durability waiters, with wait_mutex (not mutex)
    cdef pthread_mutex_t wait_mutex
    cdef pthread_cond_t dispatch_cv      # the callback dispatcher, with mutex
    cdef uint64_t* log_end
    cdef int64_t* log_ns
    cdef uint64_t log_count
    cdef list callbacks
    cdef uint64_t pending_ends[256]      # ends of placed records whose callback is not registered yet
    cdef int pending_count
    cdef int ncallbacks                  # entries in `callbacks` (readable without the GIL)
    cdef pthread_cond_t reg_cv
    cdef uint64_t callback_seq
    cdef uint64_t dispatched_end
    cdef uint64_t stat_records
    cdef uint64_t stat_record_bytes
    cdef uint64_t stat_batches
    cdef uint64_t stat_bytes_written
    cdef uint64_t stat_full_waits
    cdef uint64_t stat_buffer_waits     # placements that waited for a free batch buffer
    cdef int64_t stat_wait_ns           # time placements spent waiting for space or a buffer
    cdef int64_t stat_wait_max_ns       # the longest such wait of one placement
    cdef uint64_t stat_lock_waits       # engine placements that found the mutex taken
    cdef uint64_t stat_syncs            # fdatasyncs: one per group of batches written together
    cdef uint64_t write_hist[18]        # pwrite latencies of each group by WRITE_BOUNDS_NS bucket
    cdef int64_t write_ns_sum
    cdef uint64_t sync_hist[18]         # its fdatasync's
    cdef int64_t sync_ns_sum
    cdef bint initialized
    cdef object full_error
    cdef object closed_error
    cdef object failed_error
    cdef object too_large_error

    cdef void _lock_with_gil(self) noexcept
    cdef void _wake_waiters(self) noexcept nogil
    cdef void _wake_durability_waiters(self, bint dispatcher) noexcept nogil
    cdef int _reserve_pending(self) noexcept nogil
    cdef void _release_pending(self, int slot) noexcept nogil
    cdef uint64_t _dispatchable_end(self) noexcept nogil
    cdef Batch* _slot(self, uint64_t seq) noexcept nogil
    cdef void _seal(self, Batch* b, bint wrap) noexcept nogil
    cdef int _place(self, size_t body_len, uint64_t* out_pos) noexcept nogil
    cdef int _place_and_copy(self, const unsigned char* prefix, size_t plen,
                             const unsigned char* data, size_t n, uint32_t crc,
                             uint64_t* out_pos, bint may_wait) noexcept nogil
    cdef int place_record(self, const unsigned char* prefix, size_t plen,
                          const unsigned char* data, size_t n, uint64_t* out_pos, int attempts) except -1
    cdef object _place_error(self, int rc, size_t n)
    cdef object _failure(self)
    cdef void _writer_loop(self) noexcept nogil
    cdef void _advance(self) noexcept nogil
    cdef void _retire(self, uint64_t seq, uint64_t group, int err, int64_t took, int64_t synced) noexcept nogil
    cdef int _settled_locked(self, uint64_t end, bint acked) noexcept nogil
    cdef int _settled(self, uint64_t end) noexcept
    cdef int _wait(self, uint64_t end, timeout) except -1
    cdef int _wait_for(self, uint64_t end, timeout, bint acked) except -1
    cdef object failure(self)
    cdef uint64_t durable_hint(self) noexcept nogil
    cdef uint64_t acked_hint(self) noexcept nogil
    cdef bint acks_stopped(self) noexcept nogil
    cdef uint64_t untrimmed_hint(self) noexcept nogil
    cdef void _add_callback(self, AppendHandle handle, fn) except *
    cdef void _register(self, AppendHandle handle, fn, int slot) except *
    cdef bint _dispatch_all_locked(self) noexcept nogil
