"""The engine and its step loop: the `Engine` facade (`facade`) over the parts built
once at load (`parts`), a request from admission to its stored state (`sequence`), the
batch that steps every running request (`batch`), the forward passes, sampling, drafts
and stops, the queue in front of the engine thread (`scheduler`, `batch_worker`,
`tickets`), and stored states saved and restored (`state_io`). Nothing is imported
here: import the module that owns a name."""
