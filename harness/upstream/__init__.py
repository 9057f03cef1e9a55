"""An upstream source tree under the harness: a Megatron-LM checkout (`megatron_tree`: found, validated, imported),
its model built from its own classes (`tree_model`), the report rows of its runs (`tree_report`), and reading a
package's files from a tree or an installed wheel (`source_tree`)."""
