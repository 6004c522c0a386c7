"""Planning and fit: what a request will need in memory (`planner`), the plan search
within the budget (`budget`, `outside`), the process's memory part by part
(`breakdown`), and `justfit fit` (`fit`, `fit_config`, `fit_ranks`). Nothing is
imported here: import the module that owns a name."""
