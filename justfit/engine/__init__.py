"""The engine and its step loop: the `Engine` facade (`facade`), the queue, admission,
preemption and step loop (`scheduler`, `tickets`), a request from admission to its
stored state (`sequence`, sampling and stop text in `decoder`, drafting in `drafting`,
its state's source in `state_source`), a step's forward (`batch`), the forward passes,
sampling, drafts and stops, and stored states saved and restored (`state_io`). Nothing is imported here: import the module that owns a name."""
