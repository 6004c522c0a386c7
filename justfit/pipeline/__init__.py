"""A layer pipeline over the ranks of an `mx.distributed` group: the layers split and
run (`layers`, `stand_ins`), transfers between ranks (`link`), local ranks (`launch`),
state saved per rank (`state`) and the stall watchdog (`stall`). The engine runs it
through its runner, justfit.engine.pipeline_runner. Nothing is imported here: import
the module that owns a name."""
