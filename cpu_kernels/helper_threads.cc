// The spinning helper threads of helper_threads.h.

#include "helper_threads.h"

#include <sched.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace paged_jax_cpu {

namespace {

int cpus_allowed() {  // this process's CPUs (taskset, cgroups), not the machine's
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

class Helpers {
 public:
  explicit Helpers(int n) : count_(n) {
    for (int i = 0; i < n; ++i) std::thread([this] { loop(); }).detach();
  }
  int count() const { return count_; }

  void start(int wanted, std::function<void()> task) {
    bool wake;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      task_ = std::make_shared<std::function<void()>>(std::move(task));
      wanted_ = wanted;
      claimed_ = 0;
      generation_.fetch_add(1, std::memory_order_release);
      wake = sleeping_ > 0;
    }
    if (wake) wake_.notify_all();
  }

 private:
  // Spin until a new call is posted or the window ends, then sleep until one is; take
  // the call's task if it still wants a helper.
  void loop() {
    uint64_t seen = generation_.load();
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us().load());
      for (int n = 1; generation_.load(std::memory_order_acquire) == seen; ++n) {
#if defined(__x86_64__)
        _mm_pause();
#endif
        if (n % 16 == 0) {
          if (std::chrono::steady_clock::now() > until) break;
          std::this_thread::yield();  // to any thread that has work on this CPU (XLA's own)
        }
      }
      std::shared_ptr<std::function<void()>> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        if (generation_.load() == seen) {
          ++sleeping_;
          wake_.wait(lock, [&] { return generation_.load() != seen; });
          --sleeping_;
        }
        seen = generation_.load();
        if (claimed_ < wanted_) ++claimed_, task = task_;
      }
      if (task) (*task)();
    }
  }

  const int count_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::shared_ptr<std::function<void()>> task_;
  int wanted_ = 0, claimed_ = 0, sleeping_ = 0;
  std::atomic<uint64_t> generation_{0};
};

Helpers* helpers() {
  // per process: a child forked after the first call starts its own (the parent's threads,
  // and whatever lock one of them held, are not in the child)
  static std::mutex guard;
  static Helpers* instance = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(guard);
  if (instance == nullptr || owner != getpid()) {
    instance = new Helpers(cpus_allowed() - 1);  // never freed: detached threads use it until exit
    owner = getpid();
  }
  return instance;
}

}  // namespace

std::atomic<int>& spin_us() {
  static std::atomic<int> us{[] {
    const char* value = std::getenv("PAGED_JAX_CPU_SPIN_US");
    return value != nullptr ? std::max(0, std::atoi(value)) : 300;
  }()};
  return us;
}

bool start_helpers(int64_t wanted, std::function<void()> task) {
  Helpers* h = helpers();
  const int n = static_cast<int>(std::min<int64_t>(wanted, h->count()));
  if (n <= 0) return false;
  h->start(n, std::move(task));
  return true;
}

}  // namespace paged_jax_cpu

// The spin window in microseconds (0: XLA's pool).
extern "C" int paged_jax_cpu_spin_us() { return paged_jax_cpu::spin_us().load(); }

// Sets the spin window in microseconds (0: XLA's pool); returns the previous one.
extern "C" int paged_jax_cpu_set_spin_us(int us) { return paged_jax_cpu::spin_us().exchange(std::max(0, us)); }
