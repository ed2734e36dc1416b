"""A parameter server with trainers, as PyTorch's batch-update parameter server tutorial
writes it, with the import changed: rank 0 holds the model; the other ranks train and
push gradients through an RRef to the server, whose update function is
@async_execution: it replies to every trainer of a batch once the last one's gradients
arrived and the model was updated, with no thread waiting meanwhile.

    ferry run --standalone --nproc-per-node 3 python3 examples/python/parameter_server.py [STEPS]

Prints the first and last loss of trainer 1, and fails unless the loss went down.
"""

import sys
import threading

import torch

import ferry.rpc as rpc  # was: import torch.distributed.rpc as rpc
from ferry.futures import Future  # was: from torch.futures import Future

IN, OUT, BATCH = 16, 4, 32


def true_weights():
    g = torch.Generator().manual_seed(7)
    return torch.randn(IN, OUT, generator=g)


class BatchUpdateParameterServer:
    def __init__(self, batch_update_size):
        self.model = torch.nn.Linear(IN, OUT)
        self.lock = threading.Lock()
        self.future_model = Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self):
        return self.model

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        self = ps_rref.local_value()
        with self.lock:
            self.curr_update_size += 1
            for p, g in zip(self.model.parameters(), grads):
                p.grad += g
            fut = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                for p in self.model.parameters():
                    p.grad /= self.batch_update_size
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                self.curr_update_size = 0
                self.future_model = Future()
                fut.set_result(self.model)
        return fut


class Trainer:
    def __init__(self, ps_rref, seed):
        self.ps_rref = ps_rref
        self.loss_fn = torch.nn.MSELoss()
        self.gen = torch.Generator().manual_seed(seed)
        self.w = true_weights()

    def get_next_batch(self, steps):
        for _ in range(steps):
            x = torch.randn(BATCH, IN, generator=self.gen)
            yield x, x @ self.w

    def train(self, steps):
        name = rpc.get_worker_info().name
        m = self.ps_rref.rpc_sync().get_model()
        losses = []
        for inputs, labels in self.get_next_batch(steps):
            loss = self.loss_fn(m(inputs), labels)
            loss.backward()
            losses.append(loss.item())
            m = rpc.rpc_sync(self.ps_rref.owner(), BatchUpdateParameterServer.update_and_fetch_model,
                             args=(self.ps_rref, [p.grad for p in m.parameters()]))
        return name, losses


def run_trainer(ps_rref, seed, steps):
    return Trainer(ps_rref, seed).train(steps)


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    rpc.init_rpc(f"worker{_rank()}", rpc_backend_options=rpc.TensorPipeRpcBackendOptions(rpc_timeout=60))
    rc = 0
    if _rank() == 0:
        trainers = [w.name for w in rpc.get_worker_infos() if w.name != "worker0"]
        ps_rref = rpc.RRef(BatchUpdateParameterServer(len(trainers)))
        futs = [rpc.rpc_async(t, run_trainer, args=(ps_rref, i, steps)) for i, t in enumerate(trainers)]
        for f in futs:
            name, losses = f.wait()
            print(f"{name}: first loss {losses[0]:.4f}, last loss {losses[-1]:.4f} after {len(losses)} steps")
            if not losses[-1] < 0.5 * losses[0]:
                print(f"{name}: the loss did not go down", file=sys.stderr)
                rc = 1
        del ps_rref
    rpc.shutdown()
    return rc


def _rank():
    import os

    return int(os.environ["RANK"])


if __name__ == "__main__":
    sys.exit(main())
