"""Integrations of rdna4_comm with model libraries.

- :mod:`rdna4_comm.integrations.transformers`: expert-parallel Hugging Face MoE
  blocks and tensor-parallel MLPs.
- :mod:`rdna4_comm.integrations.vllm`: a vLLM plugin (the ``rdna4_comm``
  entry point of ``vllm.general_plugins``) that routes vLLM's tensor-parallel
  all_reduce and expert-parallel dispatch/combine through the library.

Each integration is imported on its own; importing rdna4_comm (or this
package) imports none of the libraries they integrate with.
"""
