"""FedOPT (Reddi et al. 2021): a server optimiser on the pseudo-gradient. Flower's ``FedAvgM`` (FedNLP's default:
server SGD with momentum) or ``FedAdam`` / ``FedYogi`` / ``FedAdagrad``; settings params ``train.fedopt``."""

from __future__ import annotations

from pipeline.experiments.methods import FedOptConfig
from pipeline.federation.strategies.registry import register_strategy


@register_strategy("fedopt")
def build(fedopt: FedOptConfig, common, client_lr):
    from flwr.serverapp import strategy as fs

    class FedAvgM(fs.FedAvgM):
        def configure_train(self, server_round, arrays, config, grid):  # Flower's keeps round 1's arrays, then W
            self.current_arrays = arrays  # the pseudo-gradient is against what the clients got: q(W) if lossy
            return super().configure_train(server_round, arrays, config, grid)

    opt = fedopt.server_optimizer
    if opt == "sgdm":
        return FedAvgM(**common, server_learning_rate=fedopt.server_lr, server_momentum=fedopt.server_momentum)
    adaptive = {"adam": fs.FedAdam, "yogi": fs.FedYogi, "adagrad": fs.FedAdagrad}
    kwargs = dict(eta=fedopt.server_lr, eta_l=client_lr, tau=fedopt.eps)
    if opt != "adagrad":
        kwargs.update(beta_1=fedopt.beta_1, beta_2=fedopt.beta_2)
    return adaptive[opt](**common, **kwargs)
