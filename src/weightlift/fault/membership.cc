// membership.h.
#include "weightlift/fault/membership.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>

#include "weightlift/comm/launch/process_alive.h"
#include "weightlift/core/json_record.h"

namespace wl::fault {

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

constexpr RecordFormat kReportFormat{.name = "weightlift-pipeline-report",
                                     .version = 1,
                                     .what = "pipeline loss report",
                                     .remedy = "run every stage with one weightlift build"};
constexpr RecordFormat kDecisionFormat{.name = "weightlift-pipeline-decision",
                                       .version = 1,
                                       .what = "pipeline recovery decision",
                                       .remedy = "run every stage with one weightlift build"};
constexpr auto kPoll = std::chrono::milliseconds(5);

json rng_to_json(const std::array<uint64_t, 4>& s) {
  json a = json::array();
  for (uint64_t w : s) a.push_back(u64_to_json(w));
  return a;
}

std::array<uint64_t, 4> rng_from_json(const json& j) {
  if (!j.is_array() || j.size() != 4) throw_field_error(j, "expected 4 words of RNG state");
  std::array<uint64_t, 4> s{};
  for (size_t i = 0; i < 4; ++i) s[i] = u64_field(j[i]);
  return s;
}

// This process's start time in clock ticks since boot (/proc/self/stat field 22): with the pid,
// it names the process, not a later one that reuses the pid.
int64_t start_ticks(int64_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  std::getline(f, stat);
  const size_t close = stat.rfind(')');  // the command name may hold spaces and parentheses
  if (close == std::string::npos) return -1;
  std::istringstream rest(stat.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && rest >> field; ++i) {
    if (i == 22) return std::atoll(field.c_str());
  }
  return -1;
}

std::string hostname() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "?";
  return buf;
}

}  // namespace

std::string report_to_json(const Report& r) {
  json j = new_record(kReportFormat);
  j.update({{"stage", r.stage},
            {"incarnation", r.incarnation},
            {"has_state", r.has_state},
            {"applied", r.applied},
            {"passes_done", r.passes_done},
            {"after_done", r.after_done},
            {"data_rng", rng_to_json(r.data_rng)},
            {"iterations", r.iterations},
            {"has_totals", r.has_totals},
            {"totals", r.totals}});
  return j.dump();
}

Result<Report> report_from_json(const std::string& text) {
  return read_record<Report>(text, "pipeline report", kReportFormat, [](const json& j) {
    Report r;
    r.stage = int(int_field_in(j.at("stage"), 0, 1 << 20));
    r.incarnation = int_field_in(j.at("incarnation"), 1, int64_t(1) << 40);
    r.has_state = j.at("has_state").get<bool>();
    r.applied = int_field_in(j.at("applied"), 0, int64_t(1) << 50);
    r.passes_done = j.at("passes_done").get<bool>();
    r.after_done = j.at("after_done").get<bool>();
    r.data_rng = rng_from_json(j.at("data_rng"));
    r.iterations = int_field_in(j.at("iterations"), 0, int64_t(1) << 50);
    r.has_totals = j.at("has_totals").get<bool>();
    r.totals = j.at("totals").get<std::array<double, 5>>();
    return Result<Report>(r);
  });
}

std::string decision_to_json(const Decision& d) {
  json j = new_record(kDecisionFormat);
  j.update({{"epoch", d.epoch},
            {"incarnations", d.incarnations},
            {"lost", d.lost},
            {"step", d.step},
            {"apply_pending", d.apply_pending},
            {"redo_after", d.redo_after},
            {"has_totals", d.has_totals},
            {"totals", d.totals},
            {"data_rng", rng_to_json(d.data_rng)},
            {"iterations", d.iterations},
            {"checkpoint", d.checkpoint},
            {"error", d.error}});
  return j.dump();
}

Result<Decision> decision_from_json(const std::string& text) {
  return read_record<Decision>(text, "pipeline decision", kDecisionFormat, [](const json& j) {
    Decision d;
    d.epoch = int_field_in(j.at("epoch"), 0, int64_t(1) << 40);
    d.incarnations = j.at("incarnations").get<std::vector<int64_t>>();
    d.lost = j.at("lost").get<std::vector<int>>();
    d.step = int_field_in(j.at("step"), 0, int64_t(1) << 50);
    d.apply_pending = j.at("apply_pending").get<bool>();
    d.redo_after = j.at("redo_after").get<bool>();
    d.has_totals = j.at("has_totals").get<bool>();
    d.totals = j.at("totals").get<std::array<double, 5>>();
    d.data_rng = rng_from_json(j.at("data_rng"));
    d.iterations = int_field_in(j.at("iterations"), 0, int64_t(1) << 50);
    d.checkpoint = j.at("checkpoint").get<std::string>();
    d.error = j.at("error").get<std::string>();
    return Result<Decision>(d);
  });
}

std::string Membership::key(const std::string& what) const { return "wl-ft/" + what; }

Result<std::unique_ptr<Membership>> Membership::join(const MembershipOptions& o) {
  std::unique_ptr<Membership> m(new Membership(o));
  const std::string stage = std::to_string(o.stage);
  WL_ASSIGN_OR_RETURN(m->incarnation_, o.store->add(m->key("inc/" + stage), 1));
  const comm::ProcessId me = comm::this_process();
  const json proc = {{"pid", me.pid},
                     {"start", start_ticks(me.pid)},
                     {"host_id", u64_to_json(me.host)},
                     {"host", hostname()}};
  WL_RETURN_IF_ERROR(o.store->set(m->key("proc/" + stage + "/" + std::to_string(m->incarnation_)),
                                  comm::to_bytes(proc.dump())));
  m->incarnations_.assign(size_t(o.stages), 1);
  return m;
}

Status Membership::connect() {
  group_.reset();  // the caller's DataParallel keeps the last epoch's until it rebinds
  comm::WorkerOptions w = o_.worker;
  w.name = "stage " + std::to_string(o_.stage);
  // A survivor that loses a peer ends the epoch for everyone: a process waiting on a live
  // neighbour that already left for the recovery would otherwise wait for its deadline, since
  // the transport only tells it of peers it talks to.
  const std::string over = key("e" + std::to_string(epoch_) + "/over");
  w.interrupt = [store = o_.store, over]() -> Status {
    Result<comm::Bytes> b = store->get(over, std::chrono::milliseconds(0));
    if (!b.ok()) return ok_status();
    return aborted("the pipeline's epoch ended: " + comm::to_string(*b));
  };
  auto g = comm::Group::connect({.store = o_.store,
                                 .rank = o_.stage,
                                 .size = o_.stages,
                                 .worker = w,
                                 .timeout = o_.timeout,
                                 .prefix = "wl-ft-e" + std::to_string(epoch_)});
  if (!g.ok()) {
    return g.status().with_context("stage " + std::to_string(o_.stage) + ": joining epoch " +
                                   std::to_string(epoch_) + " of the pipeline");
  }
  group_ = std::move(*g);
  return ok_status();
}

Result<Decision> Membership::await_decision() {
  // Epoch k's decision is the k-th ever made: read them in order until one names this
  // incarnation, waiting for the next one to be made. The survivors may spend two deadlines
  // before they decide (a silent stage's, then its replacement's), and a third settling.
  const Clock::time_point deadline = Clock::now() + 3 * o_.timeout;
  for (int64_t k = 0;;) {
    Result<comm::Bytes> b =
        o_.store->get(key("e" + std::to_string(k) + "/decision"), std::chrono::milliseconds(0));
    if (b.ok()) {
      WL_ASSIGN_OR_RETURN(Decision d, decision_from_json(comm::to_string(*b)));
      ++k;
      if (d.error.empty() && d.incarnations.size() == size_t(o_.stages) &&
          d.incarnations[size_t(o_.stage)] == incarnation_) {
        WL_RETURN_IF_ERROR(take(d));
        return d;
      }
      continue;
    }
    if (b.status().code() != StatusCode::kDeadlineExceeded) return b.status();
    if (Clock::now() > deadline) {
      return deadline_exceeded("stage " + std::to_string(o_.stage) + " (incarnation " +
                               std::to_string(incarnation_) +
                               ") replaces a lost process, but the survivors named it in no "
                               "decision within " +
                               std::to_string(3 * o_.timeout.count()) + " ms");
    }
    std::this_thread::sleep_for(kPoll);
  }
}

Result<Decision> Membership::settle(const Report& mine, const std::string& why,
                                    const std::function<void(const std::string&)>& fence) {
  const std::string e = "e" + std::to_string(epoch_) + "/";
  WL_RETURN_IF_ERROR(o_.store->set(
      key(e + "over"), comm::to_bytes("stage " + std::to_string(o_.stage) + " lost a peer; " +
                                      (why.empty() ? std::string("recovering") : why))));
  WL_RETURN_IF_ERROR(o_.store->set(key(e + "report/" + std::to_string(o_.stage)),
                                   comm::to_bytes(report_to_json(mine))));
  Gathered g{.reports = std::vector<std::optional<Report>>(size_t(o_.stages)),
             .replaced = std::vector<bool>(size_t(o_.stages), false),
             .fenced = std::vector<bool>(size_t(o_.stages), false)};
  Clock::time_point deadline = Clock::now() + o_.timeout;
  for (;;) {
    WL_ASSIGN_OR_RETURN(const int open, poll_reports(e, g));
    if (open == 0) break;
    if (Clock::now() < deadline) {
      std::this_thread::sleep_for(kPoll);
      continue;
    }
    WL_ASSIGN_OR_RETURN(const bool newly, fence_silent(g, fence));
    if (newly) deadline = Clock::now() + o_.timeout;
  }
  // One decider, the first to get here; everyone reads its decision.
  WL_ASSIGN_OR_RETURN(const int64_t turn, o_.store->add(key(e + "decider"), 1));
  if (turn == 1) {
    std::vector<Report> in;
    for (int s = 0; s < o_.stages; ++s) {
      if (g.reports[size_t(s)] && !g.replaced[size_t(s)]) in.push_back(*g.reports[size_t(s)]);
    }
    Result<Decision> d = decide(in);
    // A decision that cannot be made is everyone's error, not a wait for a decision.
    if (!d.ok()) d = Decision{.epoch = epoch_, .error = d.status().to_string()};
    WL_RETURN_IF_ERROR(o_.store->set(key(e + "decision"), comm::to_bytes(decision_to_json(*d))));
  }
  WL_ASSIGN_OR_RETURN(comm::Bytes b, o_.store->get(key(e + "decision"), o_.timeout));
  WL_ASSIGN_OR_RETURN(Decision d, decision_from_json(comm::to_string(b)));
  WL_RETURN_IF_ERROR(take(d));
  return d;
}

// One look at every stage not yet heard from in epoch `e`: its report, or a newer incarnation
// that replaced it. Returns how many are still open.
Result<int> Membership::poll_reports(const std::string& e, Gathered& g) {
  WL_RETURN_IF_ERROR(check_not_replaced());
  int open = 0;
  for (int s = 0; s < o_.stages; ++s) {
    if (g.reports[size_t(s)] || g.replaced[size_t(s)]) continue;
    WL_ASSIGN_OR_RETURN(const int64_t inc, o_.store->add(key("inc/" + std::to_string(s)), 0));
    if (inc > incarnations_[size_t(s)]) {
      g.replaced[size_t(s)] = true;
      continue;
    }
    Result<comm::Bytes> b =
        o_.store->get(key(e + "report/" + std::to_string(s)), std::chrono::milliseconds(0));
    if (b.ok()) {
      WL_ASSIGN_OR_RETURN(Report r, report_from_json(comm::to_string(*b)));
      if (r.stage != s) {
        return data_loss("the report under stage " + std::to_string(s) + "'s key in epoch " +
                         std::to_string(epoch_) + " is stage " + std::to_string(r.stage) + "'s");
      }
      g.reports[size_t(s)] = r;
      continue;
    }
    if (b.status().code() != StatusCode::kDeadlineExceeded) return b.status();
    ++open;
  }
  return open;
}

// The stages still silent past the deadline: declared gone, killed where they can be, replaced
// by their launcher. A stage already fenced once whose replacement never came is the error.
// Returns whether any stage was fenced now.
Result<bool> Membership::fence_silent(Gathered& g,
                                      const std::function<void(const std::string&)>& fence) {
  bool newly = false;
  for (int s = 0; s < o_.stages; ++s) {
    if (g.reports[size_t(s)] || g.replaced[size_t(s)]) continue;
    if (g.fenced[size_t(s)]) {
      return deadline_exceeded("stage " + std::to_string(s) + " was declared gone in epoch " +
                               std::to_string(epoch_) + " and no replacement joined within " +
                               std::to_string(o_.timeout.count()) +
                               " ms (weightlift's launcher starts one under `restart_failed`; "
                               "under another launcher, start it with the same variables)");
    }
    g.fenced[size_t(s)] = newly = true;
    std::string what = "stage " + std::to_string(s) + " (incarnation " +
                       std::to_string(incarnations_[size_t(s)]) + ") did not answer within " +
                       std::to_string(o_.timeout.count()) + " ms; declared gone";
    const int64_t killed = kill_registered(s);
    if (killed > 0) what += ", its process " + std::to_string(killed) + " killed";
    if (fence) fence(what);
  }
  return newly;
}

// Kills stage `s`'s registered process if it runs on this host and its pid still names the
// process that registered (the same start time), not one that reused the pid since. Returns
// the pid killed, or 0.
int64_t Membership::kill_registered(int s) {
  Result<comm::Bytes> p = o_.store->get(
      key("proc/" + std::to_string(s) + "/" + std::to_string(incarnations_[size_t(s)])),
      std::chrono::milliseconds(0));
  if (!p.ok()) return 0;
  const json proc = json::parse(comm::to_string(*p), nullptr, false);
  const auto integer = [&](const char* k) {
    return proc.is_object() && proc.contains(k) && proc[k].is_number_integer();
  };
  const bool host_named =
      proc.is_object() && proc.contains("host_id") && proc["host_id"].is_string() &&
      proc["host_id"].get<std::string>() == u64_to_json(comm::this_process().host);
  if (!host_named || !integer("pid") || !integer("start")) return 0;
  const int64_t pid = proc["pid"].get<int64_t>();
  if (pid > 1 && start_ticks(pid) == proc["start"].get<int64_t>() &&
      ::kill(pid_t(pid), SIGKILL) == 0) {
    return pid;
  }
  return 0;
}

Status Membership::take(const Decision& d) {
  if (!d.error.empty()) {
    return failed_precondition("the pipeline's survivors could not agree in epoch " +
                               std::to_string(d.epoch) + ": " + d.error);
  }
  if (d.incarnations.size() != size_t(o_.stages)) {
    return data_loss("the decision of epoch " + std::to_string(d.epoch) + " names " +
                     std::to_string(d.incarnations.size()) + " stages, the pipeline has " +
                     std::to_string(o_.stages));
  }
  if (d.incarnations[size_t(o_.stage)] != incarnation_) {
    return failed_precondition("stage " + std::to_string(o_.stage) +
                               ": this process (incarnation " + std::to_string(incarnation_) +
                               ") was declared gone and replaced by incarnation " +
                               std::to_string(d.incarnations[size_t(o_.stage)]) + "; it stops");
  }
  epoch_ = d.epoch + 1;
  incarnations_ = d.incarnations;
  return ok_status();
}

Status Membership::check_not_replaced() {
  WL_ASSIGN_OR_RETURN(const int64_t inc, o_.store->add(key("inc/" + std::to_string(o_.stage)), 0));
  if (inc == incarnation_) return ok_status();
  return failed_precondition("stage " + std::to_string(o_.stage) + ": this process (incarnation " +
                             std::to_string(incarnation_) +
                             ") was declared gone and replaced by incarnation " +
                             std::to_string(inc) + "; it stops");
}

Result<Decision> Membership::decide(const std::vector<Report>& reports) {
  Decision d;
  d.epoch = epoch_;
  d.incarnations.resize(size_t(o_.stages));
  for (int s = 0; s < o_.stages; ++s) {
    WL_ASSIGN_OR_RETURN(d.incarnations[size_t(s)],
                        o_.store->add(key("inc/" + std::to_string(s)), 0));
  }
  // A survivor is a stage that reported its state and has not been replaced since (one that
  // reported and then died has a newer incarnation by now, or fails the next epoch).
  std::vector<bool> survived(size_t(o_.stages), false);
  for (const Report& r : reports) {
    survived[size_t(r.stage)] = r.has_state && r.incarnation == d.incarnations[size_t(r.stage)];
  }
  for (int s = 0; s < o_.stages; ++s) {
    if (!survived[size_t(s)]) d.lost.push_back(s);
  }
  const Report* newest = nullptr;  // a survivor that applied the most steps
  for (const Report& r : reports) {
    if (survived[size_t(r.stage)] && (!newest || r.applied > newest->applied)) newest = &r;
  }
  if (!newest) {
    // No survivor holds a state to go on from (a rollback cut short, replacements not yet
    // rebuilt): every stage is lost, and the strategy's fallback rolls them all back.
    d.lost.clear();
    for (int s = 0; s < o_.stages; ++s) d.lost.push_back(s);
    for (const Report& r : reports) {
      d.step = std::max(d.step, r.applied);
      d.iterations = std::max(d.iterations, r.iterations);
    }
    WL_ASSIGN_OR_RETURN(d.checkpoint, newest_checkpoint(d.step));
    return d;
  }
  d.step = newest->applied;
  d.data_rng = newest->data_rng;
  d.iterations = newest->iterations;
  for (const Report& r : reports) {
    if (!survived[size_t(r.stage)] || r.applied == d.step) continue;
    // A survivor one step behind lost its peer inside the commit: the step committed (the
    // newest survivor applied it), and it applies it now.
    if (r.applied + 1 != d.step || !r.passes_done) {
      return internal_error("stage " + std::to_string(r.stage) + " applied step " +
                            std::to_string(r.applied) +
                            " (passes of the next done: " + (r.passes_done ? "yes" : "no") +
                            ") while stage " + std::to_string(newest->stage) + " applied step " +
                            std::to_string(d.step) + ": the commit rule was broken");
    }
    d.apply_pending = true;
  }
  // A survivor that applied the step late has not done what follows it either.
  d.redo_after = d.apply_pending;
  for (const Report& r : reports) {
    if (survived[size_t(r.stage)] && r.applied == d.step && !r.after_done) d.redo_after = true;
  }
  for (const Report& r : reports) {
    if (survived[size_t(r.stage)] && r.applied == d.step && r.has_totals) {
      d.has_totals = true;
      d.totals = r.totals;
      break;
    }
  }
  if (d.apply_pending && !d.has_totals) {
    return internal_error("stage " + std::to_string(newest->stage) + " applied step " +
                          std::to_string(d.step) + " without the sums of its commit");
  }
  WL_ASSIGN_OR_RETURN(d.checkpoint, newest_checkpoint(d.step));
  return d;
}

Status Membership::saved_checkpoint(int64_t step, const std::string& dir) {
  WL_ASSIGN_OR_RETURN(const int64_t n, o_.store->add(key("checkpoints"), 1));
  const json c = {{"step", step}, {"dir", dir}};
  return o_.store->set(key("checkpoint/" + std::to_string(n - 1)), comm::to_bytes(c.dump()));
}

Result<std::string> Membership::newest_checkpoint(int64_t step) {
  WL_ASSIGN_OR_RETURN(const int64_t n, o_.store->add(key("checkpoints"), 0));
  int64_t best = -1;
  std::string dir;
  for (int64_t i = 0; i < n; ++i) {
    // The writer counts a record before it sets it; one that dies in between leaves the
    // count without the record, and that checkpoint is passed over rather than waited for.
    Result<comm::Bytes> record =
        o_.store->get(key("checkpoint/" + std::to_string(i)),
                      std::min(o_.timeout, std::chrono::milliseconds(2000)));
    if (!record.ok() && record.status().code() == StatusCode::kDeadlineExceeded) continue;
    WL_ASSIGN_OR_RETURN(comm::Bytes b, std::move(record));
    const json c = json::parse(comm::to_string(b), nullptr, false);
    if (!c.is_object() || !c.contains("step") || !c["step"].is_number_integer() ||
        !c.contains("dir") || !c["dir"].is_string()) {
      return data_loss("the store's checkpoint record " + std::to_string(i) + " is not one");
    }
    const int64_t k = c["step"].get<int64_t>();
    if (k <= step && k > best) {
      best = k;
      dir = c["dir"].get<std::string>();
    }
  }
  return dir;
}

Result<std::vector<Membership::Process>> Membership::processes() {
  std::vector<Process> out;
  for (int s = 0; s < o_.stages; ++s) {
    const int64_t inc = incarnations_[size_t(s)];
    WL_ASSIGN_OR_RETURN(
        comm::Bytes b,
        o_.store->get(key("proc/" + std::to_string(s) + "/" + std::to_string(inc)), o_.timeout));
    const json proc = json::parse(comm::to_string(b), nullptr, false);
    Process p{.stage = s, .incarnation = inc, .pid = 0, .host = "?"};
    if (proc.is_object() && proc.contains("pid") && proc["pid"].is_number_integer())
      p.pid = proc["pid"].get<int64_t>();
    if (proc.is_object() && proc.contains("host") && proc["host"].is_string())
      p.host = proc["host"].get<std::string>();
    out.push_back(p);
  }
  return out;
}

}  // namespace wl::fault
