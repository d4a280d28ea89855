// The recording tape of step graphs (see step_graph.h).
#include "step_graph.h"

namespace step_graph {

Tape& tape() {
  static thread_local Tape t;
  return t;
}

void begin() {
  Tape& t = tape();
  TORCH_CHECK(!t.recording, "a step graph is already recording on this thread");
  t = Tape{};
  t.recording = true;
}

std::shared_ptr<StepGraph> end() {
  Tape& t = tape();
  TORCH_CHECK(t.recording, "no step graph is recording on this thread");
  auto graph = std::make_shared<StepGraph>();
  graph->ops = std::move(t.ops);
  graph->names = std::move(t.names);
  graph->broken = std::move(t.broken);
  t = Tape{};
  return graph;
}

bool in_recorded_kernel() { return tape().depth > 0; }

}  // namespace step_graph
