# Declarations of the C library pieces the core uses without the GIL: POSIX threads, clocks,
# positioned I/O and aligned allocation. Shared by cimport; no code of its own.
from libc.stdint cimport int64_t
from libc.errno cimport errno, EINTR, EIO

cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    cdef struct timespec:
        time_t tv_sec
        long tv_nsec
    ctypedef int clockid_t
    int clock_gettime(clockid_t clk, timespec* tp)
    enum: CLOCK_MONOTONIC

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    ctypedef struct pthread_condattr_t:
        pass
    int pthread_mutex_init(pthread_mutex_t* m, const void* attr)
    int pthread_mutex_destroy(pthread_mutex_t* m)
    int pthread_mutex_lock(pthread_mutex_t* m)
    int pthread_mutex_trylock(pthread_mutex_t* m)
    int pthread_mutex_unlock(pthread_mutex_t* m)
    int pthread_condattr_init(pthread_condattr_t* a)
    int pthread_condattr_setclock(pthread_condattr_t* a, clockid_t clk)
    int pthread_condattr_destroy(pthread_condattr_t* a)
    int pthread_cond_init(pthread_cond_t* c, const pthread_condattr_t* a)
    int pthread_cond_destroy(pthread_cond_t* c)
    int pthread_cond_wait(pthread_cond_t* c, pthread_mutex_t* m)
    int pthread_cond_timedwait(pthread_cond_t* c, pthread_mutex_t* m, const timespec* t)
    int pthread_cond_signal(pthread_cond_t* c)
    int pthread_cond_broadcast(pthread_cond_t* c)

cdef extern from "<unistd.h>" nogil:
    ssize_t pwrite(int fd, const void* buf, size_t count, long long offset)
    ssize_t pread(int fd, void* buf, size_t count, long long offset)
    int fdatasync(int fd)

cdef extern from "<stdlib.h>" nogil:
    int posix_memalign(void** memptr, size_t alignment, size_t size)


cdef inline int64_t monotonic_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef inline void deadline_after(timespec* out, int64_t delay_ns) noexcept nogil:
    """Absolute CLOCK_MONOTONIC time `delay_ns` from now (condition variables use that clock)."""
    cdef int64_t t = monotonic_ns() + delay_ns
    out.tv_sec = <time_t>(t // 1000000000)
    out.tv_nsec = <long>(t % 1000000000)


cdef inline int pwrite_full(int fd, const unsigned char* buf, size_t length, long long offset) noexcept nogil:
    """Write all of `buf` at `offset`; returns 0 or an errno. Retries short writes and EINTR."""
    cdef ssize_t n
    cdef int err
    while length > 0:
        n = pwrite(fd, buf, length, offset)
        if n < 0:
            err = errno
            if err == EINTR:
                continue
            return err
        if n == 0:
            return EIO
        buf += n
        length -= <size_t>n
        offset += n
    return 0


cdef inline int pread_full(int fd, unsigned char* buf, size_t length, long long offset) noexcept nogil:
    """Read exactly `length` bytes at `offset`; returns 0, an errno, or -1 at end of file."""
    cdef ssize_t n
    cdef int err
    while length > 0:
        n = pread(fd, buf, length, offset)
        if n < 0:
            err = errno
            if err == EINTR:
                continue
            return err
        if n == 0:
            return -1
        buf += n
        length -= <size_t>n
        offset += n
    return 0


cdef extern from *:
    """
    #if defined(__x86_64__) || defined(__i386__)
    #include <immintrin.h>
    static inline void s3s_cpu_relax(void) { _mm_pause(); }
    #elif defined(__aarch64__)
    static inline void s3s_cpu_relax(void) { __asm__ __volatile__("yield"); }
    #else
    static inline void s3s_cpu_relax(void) { }
    #endif
    """
    void cpu_relax "s3s_cpu_relax" () nogil


cdef inline bint trylock_spinning(pthread_mutex_t* m, int attempts) noexcept nogil:
    """Try to take `m` up to `attempts` times (at least once), pausing the CPU between tries:
    for a caller that must not give up the GIL while it waits for a briefly held mutex."""
    cdef int i
    if pthread_mutex_trylock(m) == 0:
        return True
    for i in range(1, attempts):
        cpu_relax()
        if pthread_mutex_trylock(m) == 0:
            return True
    return False


cdef inline void lock_releasing_gil(pthread_mutex_t* m) noexcept:
    """Take `m` from a thread holding the GIL: at once if it is free, else wait for it without
    the GIL (its holder may need the GIL to finish). For mutexes that no GIL-free thread takes;
    the WAL ring's mutex, which its writers take, has a stricter rule (walring.pyx)."""
    if pthread_mutex_trylock(m) != 0:
        with nogil:
            pthread_mutex_lock(m)
