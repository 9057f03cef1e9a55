"""The functional mini-training that runs inside each rank: recipes and their resolution (`recipe`,
`model_args`, `numerics`), the dataset (`data`), the trainer on megatron-core (`trainer`), its
checkpoints (`checkpoint`), metrics (`metrics`) and the `torchrun` entry point (`worker`). The recipes
(`recipes/*.yaml`) and the corpus (`corpus/*.txt`) are this package's data, so an installed harness finds
them; the tests stay in `suites/functional/`; launching is `harness.launch`."""
