// Step graphs: record the kernel calls of one decode forward, replay them later from C++ in one call.
//
// On two CPU cores a batch-1 decode step of a small model spends about a third of its time in Python and
// torch dispatch between ~200 kernel calls. While a tape records, every bound kernel keeps its arguments
// (tensor handles, so their storage stays alive at the same address) and runs as usual; replay calls the
// same kernels on the same tensors in the same order with no Python in between. That is only valid when
// nothing but these kernels computes during the recorded forward (views and allocations may happen, any
// other torch op may not): the Python side checks that, and replays a graph only after it matched an
// eager forward (worker/cpu_graphs.py).
#pragma once
#include <torch/extension.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace step_graph {

struct Tape {
  bool recording = false;
  int depth = 0;  // > 0 while a bound kernel runs: the torch ops it issues itself are part of it
  std::vector<std::function<void()>> ops;
  std::vector<const char*> names;  // the kernel of each op (string literals of the bindings)
  std::string broken;  // why the recording cannot be replayed (empty when it can)
};

Tape& tape();

// What end_step_graph returns: the recorded calls, replayed in order.
struct StepGraph {
  std::vector<std::function<void()>> ops;
  std::vector<const char*> names;
  std::string broken;
  void replay() const {
    for (const auto& op : ops) op();
  }
  // Replays `reps` times timing every op: (kernel name, seconds summed over the reps) per op, in order. The ops
  // run in their recorded order, so each sees the caches a real replay leaves it.
  std::vector<std::pair<std::string, double>> profile(int64_t reps) const {
    std::vector<double> seconds(ops.size(), 0.0);
    for (int64_t r = 0; r < reps; ++r)
      for (size_t i = 0; i < ops.size(); ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        ops[i]();
        seconds[i] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
    std::vector<std::pair<std::string, double>> out;
    for (size_t i = 0; i < ops.size(); ++i) out.emplace_back(names[i], seconds[i]);
    return out;
  }
};

void begin();
std::shared_ptr<StepGraph> end();
bool in_recorded_kernel();

// A bound kernel that records itself when a tape records. Out >= 0: the index of its optional `out`
// argument; the tensor it returns while recording becomes that argument, so replay writes into it again.
template <int Out, typename R, typename... Args>
auto recorded(const char* name, R (*fn)(Args...)) {
  return [name, fn](Args... args) -> R {
    Tape& t = tape();
    if (!t.recording || t.depth > 0) return fn(std::forward<Args>(args)...);
    auto stored = std::make_shared<std::tuple<std::decay_t<Args>...>>(args...);
    struct Depth {
      Tape& t;
      explicit Depth(Tape& tape) : t(tape) { ++t.depth; }
      ~Depth() { --t.depth; }
    };
    auto replay = [fn, stored] { std::apply(fn, *stored); };
    if constexpr (std::is_void_v<R>) {
      {
        Depth scope(t);
        fn(std::forward<Args>(args)...);
      }
      t.ops.push_back(std::move(replay));
      t.names.push_back(name);
    } else {
      R result = [&] {
        Depth scope(t);
        return fn(std::forward<Args>(args)...);
      }();
      if constexpr (Out >= 0 && std::is_same_v<R, torch::Tensor>) {
        std::get<Out>(*stored) = result;
      } else if (t.broken.empty()) {
        t.broken = std::string(name) + " returns a tensor that a replay would not refill";
      }
      t.ops.push_back(std::move(replay));
      t.names.push_back(name);
      return result;
    }
  };
}

}  // namespace step_graph
