"""How modules are launched, kept apart from what they compute.

``flash_models.modules`` holds the math: one plain forward per module, readable like the model. This layer
holds the ways the same computation is run faster on a given device: CUDA-graph capture and replay, decode
steps over a block's weights with folded norms and programmatic launch, lean CPU decode steps. Each one is
tested against the plain forward. Models pick a runtime path; modules never import this layer."""
