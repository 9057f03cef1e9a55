"""One home for starting processes: `torchrun` subprocesses with a timeout (`torchrun`), the c10d
rendezvous and its watcher (`rendezvous`), several local node agents (`nodes`), and the functional
suite's runs of a recipe on top of them (`runs`: plan, launch, collect; `multinode`: the node agents'
CLI). What runs inside a rank is `harness.training`."""
