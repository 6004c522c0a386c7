"""The engine and its step loop: the `Engine` facade (`facade`) over the parts built
once at load (`parts`); the queue, admission, preemption and step loop (`scheduler`,
`tickets`); a request from admission to its stored state (`sequence`, sampling and stop
text in `decoder`, drafting in `drafting`, its state's source in `state_source`); a
step's forward (`batch`); the events a request sends its client (`events`, `job`); and
stored states saved and restored (`state_io`). Nothing is imported here: import the
module that owns a name."""
