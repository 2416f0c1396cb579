# The native log cache (logcache.pyx): per-stream buffers of durable records, grouped in blocks
# that are sealed, uploaded and committed in order. Declared here for the append path.
from libc.stdint cimport uint32_t, uint64_t, int64_t
from _native.sysdeps cimport pthread_mutex_t

cdef enum:
    # A bytes payload of at least this many bytes enters the cache by reference, not copied
    # (CacheSlice.add). Below it the copy is cheap and packs small payloads densely in chunks.
    HOLD_MIN_BYTES = 8192


cdef inline object held_owner(object payload, size_t length):
    """`payload` if the cache should hold it rather than copy its `length` bytes, else None:
    only exact bytes (immutable; a bytearray or view may change after the append)."""
    return payload if type(payload) is bytes and length >= HOLD_MIN_BYTES else None


cdef class ChunkPool:
    cdef void** free_chunks[5]       # per size class, a stack of free chunks
    cdef size_t free_count[5]
    cdef size_t free_cap[5]
    cdef readonly uint64_t free_bytes
    cdef readonly uint64_t max_free_bytes
    cdef readonly uint64_t allocated  # chunks obtained from malloc (not reused)
    cdef readonly uint64_t reused

    cdef unsigned char* take(self, int size_class) noexcept
    cdef void give(self, unsigned char* chunk, int size_class) noexcept


cdef class CacheSlice:
    cdef readonly uint64_t stream_id
    cdef readonly uint64_t epoch
    cdef readonly int64_t block_id
    cdef ChunkPool pool
    cdef unsigned char** chunks      # the chunks holding the payloads ...
    cdef signed char* chunk_class    # ... their size class (-1: a dedicated allocation)
    cdef size_t nchunks
    cdef size_t chunks_cap
    cdef unsigned char* fill         # next free byte of the last chunk
    cdef size_t room                 # bytes left there
    cdef readonly uint64_t size      # payload bytes
    cdef uint64_t* bases             # base offset of each batch
    cdef uint32_t* counts            # records in each batch
    cdef const unsigned char** data  # where each payload is
    cdef size_t* lengths             # its length
    cdef void** owners               # per batch: the bytes object holding it (a reference), or
                                     # NULL if copied into a chunk; NULL until a batch is held
    cdef size_t n                    # batches
    cdef size_t cap                  # capacity of the four arrays
    cdef readonly uint64_t admitted  # payload bytes that went through append admission
    cdef readonly uint64_t wal_start # WAL offset of its first record (its lowest: appends are in WAL order)
    cdef readonly int64_t first_ns   # the cache's clock when its first record came

    cdef unsigned char* _reserve(self, size_t length) except NULL
    cdef int add(self, uint64_t base, uint32_t count, const unsigned char* data, size_t length,
                 object owner=*) except -1
    cdef size_t find(self, uint64_t offset) noexcept


cdef class CacheBlock:
    cdef readonly int64_t block_id
    cdef public str state
    cdef readonly dict streams       # stream id -> CacheSlice
    cdef readonly uint64_t size      # payload bytes
    cdef readonly uint64_t admitted  # payload bytes that went through append admission
    cdef readonly uint64_t wal_start # lowest WAL offset of a record in the block (0 if empty)
    cdef readonly uint64_t wal_end   # end of the block's last WAL record
    cdef readonly int64_t created_ns # when its oldest record came (0 while empty)
    cdef readonly str sealed_by      # why it was sealed (UploadPolicy's names), "" while active


cdef class LogCache:
    cdef readonly uint64_t threshold
    cdef readonly uint64_t split_size     # a slice reaching it is cut out of the active block (0: never)
    cdef readonly uint64_t cut_min        # slices at least this large go up with a cut (3/4 of split_size)
    cdef readonly uint64_t cache_size
    cdef object clock
    cdef object batch_type
    cdef object blocks               # deque of sealed and committed blocks, oldest first
    cdef CacheBlock active
    cdef int64_t next_id
    cdef uint64_t nbytes
    cdef ChunkPool pool
    cdef pthread_mutex_t mutex
    cdef bint mutex_ready

    cdef void acquire(self) noexcept
    cdef void release(self) noexcept
    cdef CacheBlock _new_block(self)
    cdef CacheSlice _slice_for(self, uint64_t stream_id, uint64_t epoch)
    cdef int insert(self, CacheSlice s, uint64_t base, uint32_t count, const unsigned char* data,
                    size_t length, uint64_t wal_start, uint64_t wal_end, bint admitted,
                    object owner=*) except -1
    cdef CacheBlock _seal_locked(self, str reason=*)
    cdef CacheBlock _cut_locked(self, uint64_t keep_below, object stream_id)
