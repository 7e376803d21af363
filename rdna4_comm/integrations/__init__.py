"""Integrations of rdna4_comm with model libraries.

- :mod:`rdna4_comm.integrations.transformers`: expert-parallel Hugging Face MoE
  blocks and tensor-parallel MLPs.

Each integration is imported on its own; importing rdna4_comm (or this
package) imports none of the libraries they integrate with.
"""
