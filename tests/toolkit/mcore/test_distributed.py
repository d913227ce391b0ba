"""Process groups and megatron's grid, in this process (one rank)."""
import torch

from toolkit.mcore.distributed import destroy, init_parallel, release_model_parallel
from toolkit.parallel.layout import Layout


def test_a_grid_torn_down_leaves_no_moe_loss_tracker():
    """megatron's MoE auxiliary-loss tracker (a module-level dict of tensors sized to one model's
    layers, holding that grid's groups) is emptied with the grid: a next model with more layers,
    e.g. an MTP layer's router writing at index num_layers, indexed past the old tensor's end."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker, save_to_aux_losses_tracker

    init_parallel(Layout())
    save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(0.5), layer_number=4, num_layers=4)
    assert get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].tolist() == [0, 0, 0, 0.5]
    release_model_parallel()
    assert get_moe_layer_wise_logging_tracker() == {}
    init_parallel(Layout())  # the next model: 4 layers and an MTP layer
    save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(0.25), layer_number=5, num_layers=5)
    assert get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].tolist() == [0, 0, 0, 0, 0.25]
    destroy()  # the grid, and the default group this test started
    assert get_moe_layer_wise_logging_tracker() == {}
