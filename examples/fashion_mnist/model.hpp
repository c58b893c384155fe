// The models of the Fashion-MNIST example, the same as the PyTorch peer's
// (bench/peers/torch_ddp_fmnist.py, a copy of ../shared/peers'), so throughput compares like for like.
//
// Each layer but the last is an FsdpUnit: under --shard fsdp one unit of
// FullyShardedDataParallel (gathered while it computes), and otherwise the
// layer itself (the wrapper keeps its parameter names and does nothing).
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "cohort/torch_fsdp.hpp"

template <class M>
using Unit = std::shared_ptr<cohort::torch::FsdpUnit<M>>;
template <class M>
Unit<M> unit(M layer) {
  return std::make_shared<cohort::torch::FsdpUnit<M>>(std::move(layer));
}

// conv(1->32,3x3)+ReLU+maxpool2, conv(32->64,3x3)+ReLU+maxpool2, fc(1600->128)+ReLU, fc(128->10): 225 k parameters.
struct CnnImpl : torch::nn::Module {
  CnnImpl()
      : conv1(register_module("conv1", unit(torch::nn::Conv2d(1, 32, 3)))),
        conv2(register_module("conv2", unit(torch::nn::Conv2d(32, 64, 3)))),
        fc1(register_module("fc1", unit(torch::nn::Linear(64 * 5 * 5, 128)))),
        fc2(register_module("fc2", torch::nn::Linear(128, 10))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1->forward(x)), 2);  // 26 -> 13
    x = torch::max_pool2d(torch::relu(conv2->forward(x)), 2);  // 11 -> 5
    x = torch::relu(fc1->forward(x.flatten(1)));
    return fc2->forward(x);
  }
  Unit<torch::nn::Conv2d> conv1, conv2;
  Unit<torch::nn::Linear> fc1;
  torch::nn::Linear fc2;
};
TORCH_MODULE(Cnn);

// 784->2048->2048->2048->10 with ReLU: 10.02 M parameters, 40 MB of f32 gradients (communication-bound).
struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", unit(torch::nn::Linear(784, 2048)))),
        fc2(register_module("fc2", unit(torch::nn::Linear(2048, 2048)))),
        fc3(register_module("fc3", unit(torch::nn::Linear(2048, 2048)))),
        fc4(register_module("fc4", torch::nn::Linear(2048, 10))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(fc1->forward(x.flatten(1)));
    x = torch::relu(fc2->forward(x));
    x = torch::relu(fc3->forward(x));
    return fc4->forward(x);
  }
  Unit<torch::nn::Linear> fc1, fc2, fc3;
  torch::nn::Linear fc4;
};
TORCH_MODULE(Mlp);

// 784->2048, 48 x (2048->2048), 2048->10 with ReLU: 203.0 M parameters, 812 MB
// of f32 weights, 3.2 GB with AdamW's state and the gradients: the model
// --shard fsdp trains where DDP's replicas would not fit (docs/fsdp.md).
struct BigMlpImpl : torch::nn::Module {
  static constexpr int kHidden = 48;
  BigMlpImpl() : in(register_module("in", unit(torch::nn::Linear(784, 2048)))) {
    for (int i = 0; i < kHidden; ++i) {
      std::string name = "h";  // (not "h" + to_string: GCC 12 warns, wrongly, of an overlapping memcpy)
      name += std::to_string(i);
      hidden.push_back(register_module(name, unit(torch::nn::Linear(2048, 2048))));
    }
    out = register_module("out", torch::nn::Linear(2048, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(in->forward(x.flatten(1)));
    for (auto& h : hidden) x = torch::relu(h->forward(x));
    return out->forward(x);
  }
  Unit<torch::nn::Linear> in;
  std::vector<Unit<torch::nn::Linear>> hidden;
  torch::nn::Linear out{nullptr};
};
TORCH_MODULE(BigMlp);
