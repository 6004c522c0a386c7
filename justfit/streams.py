"""One MLX stream every thread can use. MLX's default streams belong to the thread
that made them, and a lazy array (a weight loaded on demand, a state restored from
disk) can only be evaluated on its stream's thread; the server computes on a worker
thread, on arrays the main thread created. The scheduler runs one request at a time,
so the stream is never used by two threads at once."""

import mlx.core as mx

SHARED = mx.new_thread_unsafe_stream(mx.default_device())


def use_shared_stream() -> None:
    """Make the shared stream this thread's default (call once per thread)."""
    mx.set_default_stream(SHARED)
