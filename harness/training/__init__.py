"""The functional mini-training that runs inside each rank: recipes and their resolution (`recipe`,
`model_args`, `numerics`), the dataset (`data`), the trainer on megatron-core (`trainer`), its
checkpoints (`checkpoint`), metrics (`metrics`) and the `torchrun` entry point (`worker`). The recipes
themselves, the corpus and the tests stay in `suites/functional/`; launching is `harness.launch`."""
