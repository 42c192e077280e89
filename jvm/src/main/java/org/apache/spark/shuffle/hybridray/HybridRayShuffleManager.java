package org.apache.spark.shuffle.hybridray;

import com.fasterxml.jackson.databind.node.ArrayNode;
import com.fasterxml.jackson.databind.node.ObjectNode;
import io.ray.api.Ray;
import java.io.IOException;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.atomic.AtomicBoolean;
import org.apache.spark.ShuffleDependency;
import org.apache.spark.SparkConf;
import org.apache.spark.SparkContext;
import org.apache.spark.SparkEnv;
import org.apache.spark.TaskContext;
import org.apache.spark.scheduler.SparkListener;
import org.apache.spark.scheduler.SparkListenerExecutorRemoved;
import org.apache.spark.scheduler.SparkListenerTaskStart;
import org.apache.spark.shuffle.ShuffleHandle;
import org.apache.spark.shuffle.ShuffleReadMetricsReporter;
import org.apache.spark.shuffle.ShuffleReader;
import org.apache.spark.shuffle.ShuffleWriteMetricsReporter;
import org.apache.spark.shuffle.ShuffleWriter;
import org.apache.spark.shuffle.sort.SortShuffleManager;
import org.apache.spark.shuffle.sort.BypassMergeSortShuffleHandle;
import org.apache.spark.shuffle.sort.SerializedShuffleHandle;
import org.apache.spark.shuffle.sort.SortShuffleWriter;
import org.apache.spark.shuffle.sort.UnsafeShuffleWriter;
import org.apache.spark.shuffle.BaseShuffleHandle;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * Spark's {@code spark.shuffle.manager} for hybrid_ray: every ordinary shuffle's map output
 * goes into hybrid_ray's tiers (the Ray object store, then the node's spill dirs) under the
 * same shuffle master and tier managers as the Ray shuffles; reducers read it back from
 * there. Extends {@code SortShuffleManager}: barrier stages and push-based shuffles, which
 * hybrid_ray does not serve, fall back to Spark's own shuffle, unchanged.
 *
 * <p>Settings (Spark confs, all optional; {@code spark_bridge.init_spark} sets them):
 * {@code spark.hybridray.namespace} (Ray namespace of the master, default "hybrid_ray"),
 * {@code spark.hybridray.config} (the ShuffleConfig as JSON), {@code spark.hybridray.segmentBytes}
 * (4m), {@code spark.hybridray.flushBytes} (32m: map output stored per batch of this size),
 * {@code spark.hybridray.fetchTimeoutMs} (10min), {@code spark.hybridray.packBytes} (512k: small
 * memory-tier segments of a batch share one object up to this size).
 */
public class HybridRayShuffleManager extends SortShuffleManager {
  private static final Logger LOG = LoggerFactory.getLogger(HybridRayShuffleManager.class);
  private static final long HEARTBEAT_MS = 5_000;
  private static final long HEARTBEAT_JOIN_MS = 30_000;

  private final SparkConf conf;
  private final boolean isDriver;
  // Driver: the shuffles registered through hybrid_ray (released at unregister/stop).
  private final Set<Integer> hybridShuffles = ConcurrentHashMap.newKeySet();
  private volatile Thread heartbeat;
  // Set by stop(): Spark's cleaner may still unregister a shuffle afterwards, and asking
  // for the context then built a new one (its sender thread included) that nothing stopped.
  private volatile boolean stopped;

  // The driver's manager, for quiesceDriver(); set while its SparkContext runs.
  private static volatile HybridRayShuffleManager driverManager;
  // The driver's calls into Ray; closed once its Ray is about to shut down (quiesceDriver).
  private final RayCallGate rayCalls = new RayCallGate();
  // Whether this driver's listener for removed executors is added (watchExecutors).
  private final AtomicBoolean watchingExecutors = new AtomicBoolean();
  /** Driver: the highest task attempt id Spark launched on each live executor. */
  private final ConcurrentHashMap<String, Long> lastTaskByExecutor = new ConcurrentHashMap<>();

  public HybridRayShuffleManager(SparkConf conf) {
    super(conf);
    this.conf = conf;
    HybridRayContext.checkSettings(conf);  // a bad setting fails Spark's start, named
    this.isDriver = "driver".equals(conf.get("spark.executor.id", "driver"));
    if (isDriver) {
      driverManager = this;
      // Now, while Spark starts: spark_bridge removes the token's file once it has.
      HybridRayContext.loadDriverSessionToken(conf);
    } else {
      warmUpExecutor();
    }
  }

  /**
   * Executors: look up the shuffle master and this node's tier manager (starting it if
   * needed) and make one cross-language call, in the background when the executor starts,
   * so the first map task of the first query does not pay for the lookups, the first
   * call's set-up and the loading of the writer's and reader's classes.
   */
  private void warmUpExecutor() {
    Thread t = new Thread(() -> {
      try {
        if (!Ray.isInitialized()) {
          return;
        }
        HybridRayContext ctx = ctx();
        ctx.configNode();
        ctx.tierManager(ctx.nodeId());
        ctx.call(ctx.master(), "spark_tier_manager", ctx.nodeId());
        for (Class<?> c : new Class<?>[] {HybridRayDirectWriter.class, RaySegmentSink.class,
            MemoryLease.class, PartitionSegmenter.class, SegmentCodec.class,
            MemoryPacking.class, HybridRayShuffleReader.class, LocalSegmentFiles.class}) {
          Class.forName(c.getName(), true, c.getClassLoader());
        }
      } catch (Exception | LinkageError e) {
        // Only a head start: the first task looks everything up itself (and reports).
        LOG.debug("hybrid_ray executor warm-up failed: {}", e.toString());
      }
    }, "hybrid-ray-warm-up");
    t.setDaemon(true);
    t.start();
  }

  /**
   * Stop the driver's calls into Ray (the heartbeat thread, releases) and wait for one in
   * flight. RayDP's stop shuts the driver JVM's Ray down <em>before</em> it stops Spark, and
   * a call still using Ray's core worker then crashed the JVM; {@code spark_bridge.stop_spark}
   * calls this first (through Py4J) and releases the session's data itself.
   */
  public static void quiesceDriver() {
    HybridRayShuffleManager manager = driverManager;
    if (manager != null) {
      // A call in flight ends within the call timeout; with no context no call was made.
      long waitMs = HybridRayContext.exists() ? manager.ctx().callTimeoutMs : 0;
      try {
        if (!manager.rayCalls.closeAndDrain(waitMs)) {
          LOG.warn("hybrid_ray: a driver call into Ray still runs after {} ms; Ray shuts "
              + "down under it", waitMs);
        }
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
      }
      manager.stopHeartbeat();
      if (HybridRayContext.exists()) {
        manager.ctx().drainSender(waitMs);  // the registrations it still had to send
      }
    }
  }

  private boolean rayUsable() {
    return !rayCalls.isClosed() && Ray.isInitialized();
  }

  /** Run {@code call} into Ray unless the driver's Ray is closing; quiesceDriver waits for
   *  it. */
  private void whileRayOpen(Runnable call) {
    if (!Ray.isInitialized() || !rayCalls.enter()) {
      return;
    }
    try {
      call.run();
    } finally {
      rayCalls.exit();
    }
  }

  private void stopHeartbeat() {
    Thread beat = heartbeat;
    if (beat != null) {
      beat.interrupt();
      try {
        beat.join(HEARTBEAT_JOIN_MS);
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
      }
      heartbeat = null;
    }
  }

  private HybridRayContext ctx() {
    return HybridRayContext.get(conf);
  }

  /** Why Spark's own shuffle must serve {@code dependency}, or null if hybrid_ray can. */
  static String fallbackReason(ShuffleDependency<?, ?, ?> dependency, SparkConf conf) {
    return fallbackReason(dependency.rdd().isBarrier(), key -> conf.getBoolean(key, false));
  }

  /** Why a shuffle of a ({@code barrier}) map stage cannot go through hybrid_ray, given
   *  the Spark settings that are on ({@code enabled}: a boolean setting's value, false if
   *  unset), or null if it can. */
  static String fallbackReason(boolean barrier, java.util.function.Predicate<String> enabled) {
    if (barrier) {
      return "its map stage is a barrier stage";
    }
    if (enabled.test("spark.shuffle.push.enabled")) {
      return "push-based shuffle (spark.shuffle.push.enabled) is on";
    }
    if (enabled.test("spark.shuffle.service.enabled")) {
      // An external shuffle service serves Spark's files after their executor is gone, and
      // dynamic allocation then removes idle executors. Memory-tier segments die with their
      // executor: every reduce over them would fail its fetch and recompute, again and
      // again.
      return "the external shuffle service (spark.shuffle.service.enabled) is on: it "
          + "serves Spark's own shuffle files";
    }
    if (enabled.test("spark.shuffle.useOldFetchProtocol")) {
      // Spark then gives every attempt of a map the same map id (its partition id), and
      // hybrid_ray tells attempts apart by it: a retry's commits would be taken for the
      // aborted attempt's and dropped, a speculative copy would overwrite the accepted
      // attempt's files.
      return "the old fetch protocol (spark.shuffle.useOldFetchProtocol) is on: it gives "
          + "every attempt of a map the same id";
    }
    return null;
  }

  @Override
  public <K, V, C> ShuffleHandle registerShuffle(int shuffleId,
      ShuffleDependency<K, V, C> dependency) {
    String reason = fallbackReason(dependency, conf);
    if (reason != null) {
      LOG.warn("hybrid_ray: shuffle {} uses Spark's own shuffle: {}", shuffleId, reason);
      reportFallback(shuffleId, dependency, reason);
      return super.registerShuffle(shuffleId, dependency);
    }
    ShuffleHandle spark = super.registerShuffle(shuffleId, dependency);
    String key = ctx().shuffleKey(shuffleId);
    String token = ctx().sessionToken();
    hybridShuffles.add(shuffleId);
    startHeartbeat();
    registerAtMaster(shuffleId, dependency, key);
    watchExecutors(dependency.rdd().sparkContext());
    // The same writer path as Spark's would take (see HybridRayShuffleHandle).
    if (spark instanceof BypassMergeSortShuffleHandle) {
      return new HybridRayShuffleHandle.Bypass<>(shuffleId,
          ((BypassMergeSortShuffleHandle<K, V>) spark).dependency(), key, token);
    }
    if (spark instanceof SerializedShuffleHandle) {
      return new HybridRayShuffleHandle.Serialized<>(shuffleId,
          ((SerializedShuffleHandle<K, V>) spark).dependency(), key, token);
    }
    return new HybridRayShuffleHandle<>(shuffleId, dependency, key, token);
  }

  @Override
  @SuppressWarnings("unchecked")
  public <K, V> ShuffleWriter<K, V> getWriter(ShuffleHandle handle, long mapId,
      TaskContext context, ShuffleWriteMetricsReporter metrics) {
    if (!(handle instanceof HybridRayHandle)) {
      return super.getWriter(handle, mapId, context, metrics);
    }
    ctx().adoptSession(((HybridRayHandle) handle).sessionToken());
    boolean direct = handle instanceof HybridRayShuffleHandle.Serialized
        || handle instanceof HybridRayShuffleHandle.Bypass;
    // Decided once per map task: it builds the compression codec to ask it.
    boolean relocatable = direct && HybridRayDirectWriter.relocatable(
        ((BaseShuffleHandle<K, V, ?>) handle).dependency(), SparkEnv.get());
    if (handle instanceof HybridRayShuffleHandle.Serialized && !relocatable) {
      // More partitions than Spark's bypass threshold, and records that cannot be kept
      // serialized between flushes (I/O encryption: cipher streams do not concatenate).
      // The direct writer would keep a cipher and codec stream per partition open for the
      // whole task (~100 KiB each: 6,000 partitions ran a 512 MB executor out of heap).
      // Spark's serialized writer bounds the memory (it sorts serialized records in pages
      // and spills them to a local file when short of memory); it serializes each record
      // at once, so SQL's reused row objects are safe, and its output goes to the tiers.
      SparkEnv env = SparkEnv.get();
      try {
        return new UnsafeShuffleWriter<>(env.blockManager(), context.taskMemoryManager(),
            (HybridRayShuffleHandle.Serialized<K, V>) handle, mapId, context, env.conf(),
            metrics,
            new HybridRayExecutorComponents(ctx(), (HybridRayHandle) handle, context));
      } catch (org.apache.spark.SparkException e) {
        // Thrown only above the serialized writer's partition limit, which Spark checked
        // before it chose that path for the handle.
        throw new IllegalStateException("hybrid_ray: Spark's serialized writer refused "
            + "shuffle " + handle.shuffleId() + ": " + e.getMessage(), e);
      }
    }
    if (direct) {
      // No map-side combine: records go straight into per-partition memory buffers and
      // from there into the tiers, never through Spark's local dir (see the writer).
      BaseShuffleHandle<K, V, ?> base = (BaseShuffleHandle<K, V, ?>) handle;
      return new HybridRayDirectWriter<>(ctx(), (HybridRayHandle) handle, base.dependency(),
          mapId, context, metrics, relocatable);
    }
    // Map-side combine (reduceByKey, SQL-less aggregations): Spark's sort writer, whose
    // sorter keeps the data in memory unless the task runs short of it.
    HybridRayExecutorComponents components =
        new HybridRayExecutorComponents(ctx(), (HybridRayHandle) handle, context);
    return new SortShuffleWriter<>((HybridRayShuffleHandle<K, V, Object>) handle, mapId,
        context, metrics, components);
  }

  @Override
  public <K, C> ShuffleReader<K, C> getReader(ShuffleHandle handle, int startMapIndex,
      int endMapIndex, int startPartition, int endPartition, TaskContext context,
      ShuffleReadMetricsReporter metrics) {
    if (!(handle instanceof HybridRayHandle)) {
      return super.getReader(handle, startMapIndex, endMapIndex, startPartition, endPartition,
          context, metrics);
    }
    ctx().adoptSession(((HybridRayHandle) handle).sessionToken());
    @SuppressWarnings("unchecked")
    BaseShuffleHandle<K, ?, C> h = (BaseShuffleHandle<K, ?, C>) handle;
    return new HybridRayShuffleReader<>(ctx(), h, startMapIndex, endMapIndex, startPartition,
        endPartition, context, metrics);
  }

  @Override
  public boolean unregisterShuffle(int shuffleId) {
    boolean removed = super.unregisterShuffle(shuffleId);
    if (stopped) {
      return removed;  // stop() dropped this JVM's objects and released the session's data
    }
    HybridRayContext ctx = ctx();
    ctx.dropShuffle(shuffleId);  // executors: this JVM's memory-tier objects of it go
    if (isDriver && hybridShuffles.remove(shuffleId)) {
      whileRayOpen(() -> release(ctx, new String[] {ctx.shuffleKey(shuffleId)}, null));
    }
    return removed;
  }

  @Override
  public void stop() {
    stopped = true;
    try {
      super.stop();
    } finally {
      // Never throws: SparkEnv.stop() calls this first, and an exception here skipped the
      // rest of Spark's shutdown (block manager, RPC env). No context is made just for
      // this: without one, this JVM never stored or registered anything.
      try {
        stopHeartbeat();
        if (HybridRayContext.exists()) {
          HybridRayContext ctx = ctx();
          ctx.dropAll();
          if (isDriver) {
            hybridShuffles.clear();
            whileRayOpen(() -> release(ctx, null, ctx.appPrefix()));
          }
        }
      } catch (RuntimeException e) {
        LOG.warn("hybrid_ray: stopping the shuffle manager failed: {}; the shuffle master "
            + "releases this application's data after its orphan TTL", e.toString());
      } finally {
        if (isDriver && driverManager == this) {
          driverManager = null;
        }
        HybridRayContext.reset();
      }
    }
  }

  /** Register a hybrid_ray shuffle with the master before any of its map tasks runs. A
   *  task's first call (its memory lease) registers the shuffle on its node's tier manager,
   *  and a tier manager releases a shuffle the master has not known for two of its sweeps
   *  (30-60 s): registered only at its first commit, a shuffle whose map tasks computed for
   *  longer than that before committing was released under them. Sent without waiting
   *  (planning a query registers several shuffles; none of it may wait on the master) and
   *  best effort: the first commit registers a shuffle whose registration did not arrive. */
  private void registerAtMaster(int shuffleId, ShuffleDependency<?, ?, ?> dependency,
      String key) {
    if (!isDriver || !rayUsable()) {
      return;
    }
    try {
      HybridRayContext ctx = ctx();
      ObjectNode request = ctx.json.createObjectNode();
      request.put("shuffle", key);
      request.put("num_partitions", dependency.partitioner().numPartitions());
      request.set("config", ctx.configNode());
      ctx.callAsync(ctx.master(), "spark_register", ctx.toJson(request));
    } catch (Exception e) {
      LOG.warn("hybrid_ray: could not register shuffle {} with the master before its map "
          + "tasks ({}); its first commit registers it", shuffleId, e.toString());
    }
  }

  /**
   * Driver: from the first shuffle on, tell the master about every executor Spark removes,
   * so it drops the map attempts that executor wrote. Their memory-tier objects died with
   * it, and Spark (without an external shuffle service) recomputes all its map outputs
   * before any reader asks, so no reader ever reports them lost: they stayed counted in
   * the node's memory books (and their files on disk) until the shuffle's release.
   */
  private void watchExecutors(SparkContext sc) {
    if (!isDriver || !watchingExecutors.compareAndSet(false, true)) {
      return;
    }
    sc.addSparkListener(new SparkListener() {
      @Override
      public void onTaskStart(SparkListenerTaskStart started) {
        lastTaskByExecutor.merge(started.taskInfo().executorId(), started.taskInfo().taskId(),
            Math::max);
      }

      @Override
      public void onExecutorRemoved(SparkListenerExecutorRemoved removed) {
        // The listener bus delivers in order: every task start on this executor came first.
        Long lastTask = lastTaskByExecutor.remove(removed.executorId());
        whileRayOpen(() -> sendExecutorLost(removed.executorId(),
            lastTask == null ? -1L : lastTask));
      }
    });
  }

  /**
   * {@code lastTask}: the highest task attempt id (a map attempt's id) Spark launched on the
   * executor. A commit of one of those reaching the master after this (sent before the
   * executor died) is dropped; an executor RayDP restarts under the same id runs tasks
   * with higher ids, whose commits count.
   */
  private void sendExecutorLost(String executorId, long lastTask) {
    try {
      HybridRayContext ctx = ctx();
      ObjectNode request = ctx.json.createObjectNode();
      request.put("prefix", ctx.appPrefix());
      request.put("executor", executorId);
      request.put("last_task", lastTask);
      ctx.callAsync(ctx.master(), "spark_executor_lost", ctx.toJson(request));
    } catch (Exception e) {
      LOG.warn("hybrid_ray: could not tell the master that executor {} is gone; its map "
          + "outputs stay counted until their shuffles' release: {}", executorId, e.toString());
    }
  }

  /** Tell the master that Spark's own shuffle serves {@code shuffleId} and why, so the
   *  session's reports show it (best effort: the log has it anyway). */
  private void reportFallback(int shuffleId, ShuffleDependency<?, ?, ?> dependency,
      String reason) {
    if (isDriver) {
      whileRayOpen(() -> sendFallback(shuffleId, dependency, reason));
    }
  }

  private void sendFallback(int shuffleId, ShuffleDependency<?, ?, ?> dependency,
      String reason) {
    try {
      HybridRayContext ctx = ctx();
      ObjectNode request = ctx.json.createObjectNode();
      request.put("shuffle", ctx.shuffleKey(shuffleId));
      request.put("reason", reason);
      request.put("num_partitions", dependency.partitioner().numPartitions());
      request.put("num_maps", dependency.rdd().getNumPartitions());
      ctx.call(ctx.master(), "spark_fallback", ctx.toJson(request));
    } catch (Exception e) {
      LOG.debug("hybrid_ray: could not report the fallback of shuffle {}: {}", shuffleId,
          e.toString());
    }
  }

  /** Tell the master to release shuffles (by key, or all of an application's). */
  private static void release(HybridRayContext ctx, String[] keys, String appPrefix) {
    if (!Ray.isInitialized()) {
      LOG.warn("hybrid_ray: this driver is not connected to Ray; shuffle data is released "
          + "by spark_bridge.stop_spark() or after the master's orphan TTL");
      return;
    }
    try {
      ObjectNode request = ctx.json.createObjectNode();
      if (keys != null) {
        ArrayNode list = request.putArray("shuffles");
        for (String key : keys) {
          list.add(key);
        }
      }
      if (appPrefix != null) {
        request.put("prefix", appPrefix);
      }
      ctx.call(ctx.master(), "spark_release", ctx.toJson(request));
    } catch (Exception e) {
      LOG.warn("hybrid_ray: releasing shuffle data failed (the master's orphan TTL removes "
          + "it later): {}", e.toString());
    }
  }

  /** Driver: heartbeat this application's shuffles so the master's orphan TTL spares them. */
  private synchronized void startHeartbeat() {
    if (!isDriver || heartbeat != null) {
      return;
    }
    Thread t = new Thread(() -> {
      while (!Thread.currentThread().isInterrupted()) {
        try {
          if (!hybridShuffles.isEmpty()) {
            whileRayOpen(this::sendHeartbeat);
          }
          Thread.sleep(HEARTBEAT_MS);
        } catch (InterruptedException e) {
          return;
        } catch (Exception e) {
          LOG.debug("hybrid_ray heartbeat failed: {}", e.toString());
          try {
            Thread.sleep(HEARTBEAT_MS);
          } catch (InterruptedException ie) {
            return;
          }
        }
      }
    }, "hybrid-ray-shuffle-heartbeat");
    t.setDaemon(true);
    t.start();
    heartbeat = t;
  }

  private void sendHeartbeat() {
    HybridRayContext ctx = ctx();
    ObjectNode request = ctx.json.createObjectNode();
    request.put("prefix", ctx.appPrefix());
    try {
      ctx.call(ctx.master(), "spark_heartbeat", ctx.toJson(request));
    } catch (IOException e) {
      LOG.debug("hybrid_ray heartbeat failed: {}", e.toString());
    }
  }

  /** The executor's or driver's SparkEnv is up (for callers that need it explicitly). */
  static boolean hasSparkEnv() {
    return SparkEnv.get() != null;
  }
}
