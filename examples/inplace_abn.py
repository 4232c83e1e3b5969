"""In-place activated BatchNorm: convert a CNN, check it trains the same, see the memory saved.

Run from the repository root: ``python examples/inplace_abn.py`` (a few seconds on a CPU).

`convert_bn_act` swaps every BatchNorm2d + LeakyReLU pair inside an nn.Sequential for one
`InPlaceABN`, which keeps a single tensor for backward instead of two. The converted model loads
the original's state_dict unchanged, gives the same gradients, and composes with ckpt_graph
regions.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import ckpt_graph as cg
from ckpt_graph.memory import measure, measure_with_result
from ckpt_graph.nn import InPlaceABN, convert_bn_act


def make_cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.LeakyReLU(0.01),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.LeakyReLU(0.01),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def main() -> None:
    reference = make_cnn()
    model = convert_bn_act(copy.deepcopy(reference))
    print(model)  # InPlaceABN at indices 1 and 4, nn.Identity where the activations were
    model.load_state_dict(reference.state_dict())  # the state_dict layout is unchanged

    # Same training trajectory: two SGD steps on random data.
    x = torch.randn(16, 3, 32, 32)
    target = torch.randint(0, 10, (16,))
    for net in (reference, model):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), target).backward()
            opt.step()
    for (name, p), q in zip(
        reference.state_dict().items(), model.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=f"{name} differs")
    print("same parameters and running stats after 2 steps")

    # Memory kept for backward after the forward, and the peak of forward + backward.
    def loss_of(net: nn.Module) -> torch.Tensor:
        return nn.functional.cross_entropy(net(x), target)

    for name, net in (("BatchNorm2d + LeakyReLU", reference), ("InPlaceABN", model)):
        loss, fwd = measure_with_result(loss_of, net)
        del loss
        step = measure(lambda n=net: loss_of(n).backward())
        print(
            f"{name:24s} kept {fwd.end_bytes / 2**20:5.1f} MiB, peak {step.peak_bytes / 2**20:5.1f} MiB"
        )

    # Inside a ckpt_graph region: the module's own saving composes with recomputation.
    with cg.save_recompute_policy(policy="recompute_all"):
        loss = loss_of(model)
    loss.backward()
    print("backward through a recompute_all region: ok")

    # A standalone layer; the input is overwritten with the output.
    abn = InPlaceABN(8, activation="elu", activation_param=1.0)
    h = torch.randn(4, 8, 5, 5) * 3
    out = abn(h)
    assert out.data_ptr() == h.data_ptr()


if __name__ == "__main__":
    main()
