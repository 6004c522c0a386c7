"""Planning and fit: what a request will need in memory (`cost_model`), the planner and
its plan search (`plan`), the budget now and its outside share (`budget`), the
process's memory part by part (`breakdown`), and `justfit fit` (`fit`, `fit_config`,
`fit_ranks`). Nothing here imports the engine; nothing is imported here: import the
module that owns a name."""
