package org.apache.spark.shuffle.hybridray;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.node.ObjectNode;
import io.ray.api.ObjectRef;
import io.ray.api.PyActorHandle;
import io.ray.api.Ray;
import io.ray.api.exception.RayActorException;
import io.ray.api.function.PyActorMethod;
import java.io.IOException;
import java.util.ArrayList;
import java.util.Collections;
import java.util.IdentityHashMap;
import java.util.List;
import java.util.Map;
import java.util.Optional;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.ConcurrentLinkedQueue;
import java.util.concurrent.Executors;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.function.Function;
import java.util.concurrent.RejectedExecutionException;
import org.apache.spark.SparkConf;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * One JVM's link to hybrid_ray (the driver's or an executor's): its settings, the handles of
 * the namespace's shuffle master and of the nodes' tier managers (Python actors, called
 * cross-language with JSON strings: only strings, bytes and numbers cross), and the
 * memory-tier objects this JVM owns.
 *
 * <p>Memory-tier segments are {@code Ray.put} by the executor that wrote them, so they are
 * owned by that executor and die with it, as Spark's own shuffle files do without an
 * external shuffle service. The executor keeps their refs here until the shuffle is
 * unregistered (or the map attempt aborted): dropping the last local ref would free them.
 */
public final class HybridRayContext {
  public static final String MASTER_NAME = "hybrid_ray_shuffle_master";
  public static final String TIER_MANAGER_PREFIX = "hybrid_ray_tier_manager_";

  public static final String CONF_NAMESPACE = "spark.hybridray.namespace";
  public static final String CONF_CONFIG = "spark.hybridray.config";
  /**
   * The field of the config this JVM sends the actors that holds spark_bridge's session
   * token (hybrid_ray's {@code spark_jvm.SESSION_FIELD}), the key the master hands the
   * session's whole config (remote-tier credentials included) out under. Never in Spark's
   * configuration: PySpark passes every Spark config on spark-submit's command line, which
   * any local user can read. The driver reads it from {@link #SESSION_FILE_FIELD}, the
   * executors from the shuffle handles ({@link HybridRayHandle#sessionToken}).
   */
  static final String SESSION_FIELD = "session_token";
  /**
   * The field of {@link #CONF_CONFIG} holding the path of the file (0600, in a 0700
   * directory, on the driver's node) from which the driver reads the session token while
   * Spark starts (hybrid_ray's {@code spark_jvm.SESSION_FILE_FIELD}); spark_bridge removes
   * it once Spark has started.
   */
  static final String SESSION_FILE_FIELD = "session_file";
  /** What a session token may hold (spark_bridge's: "s" and 32 hex digits). */
  private static final java.util.regex.Pattern TOKEN =
      java.util.regex.Pattern.compile("[A-Za-z0-9_.-]{1,128}");
  public static final String CONF_SEGMENT_BYTES = "spark.hybridray.segmentBytes";
  public static final String CONF_FLUSH_BYTES = "spark.hybridray.flushBytes";
  public static final String CONF_FETCH_TIMEOUT_MS = "spark.hybridray.fetchTimeoutMs";
  public static final String CONF_CALL_TIMEOUT_MS = "spark.hybridray.callTimeoutMs";
  public static final String CONF_PACK_BYTES = "spark.hybridray.packBytes";
  public static final String CONF_LEASE_BYTES = "spark.hybridray.leaseBytes";
  public static final String CONF_COMMIT_WAIT_MS = "spark.hybridray.commitWaitMs";

  private static final Logger LOG = LoggerFactory.getLogger(HybridRayContext.class);
  /** Sent commits kept to be checked (the oldest unanswered beyond this are not). */
  static final int MAX_SENT_COMMITS = 10_000;
  /** How often the sender looks at the answers of the commits it sent. */
  static final long SENT_COMMITS_CHECK_MS = 1000;

  /** The largest segment (hybrid_ray's ``config.MAX_SEGMENT_BYTES``, 1 GiB). */
  static final long MAX_SEGMENT_BYTES = 1L << 30;

  private static HybridRayContext instance;
  // The last session file the driver read and its token (guarded by the class): the file
  // is gone once Spark has started, and the driver's context is made later than that.
  private static String lastSessionFile;
  private static String lastSessionToken;

  final String namespace;
  /** The ShuffleConfig as JSON, for the Python side (opaque here). */
  final String configJson;
  final int segmentBytes;
  final long flushBytes;
  /** Small memory-tier segments of a batch share one Ray object up to this size
   *  ({@link MemoryPacking}); 0 puts each segment alone. */
  final long packBytes;
  /** Memory lease of a map task of a shuffle this executor has not written yet
   *  ({@link MemoryLease}); 0 turns leases off. Later tasks lease what the last one
   *  stored, with a quarter more, up to {@link #flushBytes}. */
  final long leaseBytes;
  final long fetchTimeoutMs;
  /** Bound of every call to the master or a tier manager (a wedged actor fails the task). */
  final long callTimeoutMs;
  /** How long a reader waits for the last commit of a map attempt Spark accepted (sent by
   *  its task without waiting) before it takes the attempt's output as lost. */
  final long commitWaitMs;
  final String appKey;
  /** This JVM's Spark executor id ("driver" on the driver), named in each commit. */
  final String executorId;
  final ObjectMapper json = new ObjectMapper();

  private volatile JsonNode configNode;
  private volatile PyActorHandle master;
  private volatile String nodeId;
  private volatile List<String> spillDirs;
  private final Map<String, PyActorHandle> tierManagers = new ConcurrentHashMap<>();
  private final OwnedObjects owned = new OwnedObjects();
  // Whether a collection of dropped memory-tier objects is scheduled (see
  // collectDroppedObjects).
  private final AtomicBoolean collectionScheduled = new AtomicBoolean();
  /** How long after a drop the collection runs: the drops of one cleanup share it. */
  static final long COLLECT_DELAY_MS = 500;
  // Memory leases whose answer came after their task stopped waiting: given back when it
  // comes (else the grant stayed counted against its shuffle until the release).
  private final ConcurrentLinkedQueue<LateLease> lateLeases = new ConcurrentLinkedQueue<>();
  // Submits what a map task sends without waiting (its last commit, its settlements) and
  // checks the sent commits' answers, off the task's thread: profiled on a small SQL
  // exchange, a cross-language submission took 0.6-3 ms and a Ray.wait up to 2.7 ms of a
  // map task's write. One thread: submissions leave in the order the tasks made them.
  // Every second it also looks at the answers of the commits it sent.
  private final ScheduledExecutorService sender =
      Executors.newSingleThreadScheduledExecutor(runnable -> {
        Thread thread = new Thread(runnable, "hybrid-ray-sender");
        thread.setDaemon(true);
        return thread;
      });
  // Last commits of map attempts, sent without waiting: a failed one is logged when
  // seen (its readers find the attempt missing and Spark recomputes it).
  private final ConcurrentLinkedQueue<SentCall> sentCommits = new ConcurrentLinkedQueue<>();
  // Spark shuffle id -> bytes the last map task of it stored from this executor.
  private final Map<Integer, Long> lastMapBytes = new ConcurrentHashMap<>();

  HybridRayContext(SparkConf conf) {
    this.namespace = conf.get(CONF_NAMESPACE, "hybrid_ray");
    this.configJson = conf.get(CONF_CONFIG, "{}");
    Settings settings = new Settings(conf);
    this.segmentBytes = settings.segmentBytes;
    this.flushBytes = settings.flushBytes;
    this.packBytes = settings.packBytes;
    this.leaseBytes = settings.leaseBytes;
    this.fetchTimeoutMs = settings.fetchTimeoutMs;
    this.callTimeoutMs = settings.callTimeoutMs;
    this.commitWaitMs = settings.commitWaitMs;
    // Parsed once here: the session tag needs it, and requests embed it (configNode()).
    JsonNode config;
    try {
      config = parse(configJson);
    } catch (IOException e) {
      config = null;  // configNode() raises it where the config is needed
    }
    this.configNode = config = withSession(config, isDriver(conf));
    this.appKey = appKey(conf.getAppId()) + "-" + sessionTag(config);
    this.executorId = conf.get("spark.executor.id", "driver");
    sender.scheduleWithFixedDelay(() -> {
      try {
        reportSentCommits();
        giveBackLateLeases();
      } catch (RuntimeException e) {  // (thrown, anything would end the schedule silently)
        LOG.debug("hybrid_ray: checking sent calls failed: {}", e.toString());
      } catch (Error e) {
        LOG.warn("hybrid_ray: checking sent calls failed: {}", e.toString());
      }
    }, SENT_COMMITS_CHECK_MS, SENT_COMMITS_CHECK_MS, TimeUnit.MILLISECONDS);
  }

  /**
   * Check every {@code spark.hybridray.*} size and time setting, as a context reads them:
   * an IllegalArgumentException names the first bad one. The shuffle manager calls this
   * when Spark starts, so a bad setting fails the start (checked only when the first
   * shuffle built a context, it later made the manager's stop throw, which skipped the
   * rest of Spark's shutdown).
   */
  static void checkSettings(SparkConf conf) {
    new Settings(conf);
  }

  /** The size and time settings, each checked and naming itself: a segment size cast to
   *  int from "4g" was 0, from "2g" negative, and failed later naming no setting. */
  private static final class Settings {
    final int segmentBytes;
    final long flushBytes;
    final long packBytes;
    final long leaseBytes;
    final long fetchTimeoutMs;
    final long callTimeoutMs;
    final long commitWaitMs;

    Settings(SparkConf conf) {
      segmentBytes = (int) sizeSetting(conf, CONF_SEGMENT_BYTES, "4m", 1, MAX_SEGMENT_BYTES);
      flushBytes = sizeSetting(conf, CONF_FLUSH_BYTES, "32m", 1, Long.MAX_VALUE);
      packBytes = sizeSetting(conf, CONF_PACK_BYTES, "512k", 0, MAX_SEGMENT_BYTES);
      leaseBytes = sizeSetting(conf, CONF_LEASE_BYTES, "4m", 0, Long.MAX_VALUE);
      fetchTimeoutMs = timeSetting(conf, CONF_FETCH_TIMEOUT_MS, "10min", 1);
      callTimeoutMs = timeSetting(conf, CONF_CALL_TIMEOUT_MS, "2min", 1);
      commitWaitMs = timeSetting(conf, CONF_COMMIT_WAIT_MS, "30s", 0);
    }
  }

  /**
   * Size setting {@code key} in bytes (Spark's notation: {@code 4m}, {@code 512k}), or an
   * IllegalArgumentException naming the setting, its value and the range it must be in.
   */
  static long sizeSetting(SparkConf conf, String key, String dflt, long min, long max) {
    String raw = conf.get(key, dflt);
    long value;
    try {
      value = conf.getSizeAsBytes(key, dflt);
    } catch (RuntimeException e) {
      throw new IllegalArgumentException("hybrid_ray: " + key + "=" + raw + " is not a size "
          + "in bytes; give one such as 4m or 512k (default " + dflt + ")", e);
    }
    return inRange(key, raw, value, "bytes", dflt, min, max);
  }

  /**
   * Time setting {@code key} in milliseconds (Spark's notation: {@code 30s}, {@code 2min}),
   * at least {@code min}, or an IllegalArgumentException naming the setting and its value.
   */
  static long timeSetting(SparkConf conf, String key, String dflt, long min) {
    String raw = conf.get(key, dflt);
    long value;
    try {
      value = conf.getTimeAsMs(key, dflt);
    } catch (RuntimeException e) {
      throw new IllegalArgumentException("hybrid_ray: " + key + "=" + raw + " is not a "
          + "duration; give one such as 30s or 2min (default " + dflt + ")", e);
    }
    return inRange(key, raw, value, "ms", dflt, min, Long.MAX_VALUE);
  }

  /**
   * {@code value} (setting {@code key} given as {@code raw}) if it lies in [min, max], else
   * an IllegalArgumentException naming the setting, its value and the range.
   */
  static long inRange(String key, String raw, long value, String unit, String dflt, long min,
      long max) {
    if (value < min || value > max) {
      throw new IllegalArgumentException("hybrid_ray: " + key + "=" + raw + " is " + value
          + " " + unit + "; it must be between " + min + " and " + max + " " + unit
          + " (default " + dflt + ")");
    }
    return value;
  }

  static boolean isDriver(SparkConf conf) {
    return "driver".equals(conf.get("spark.executor.id", "driver"));
  }

  /**
   * The driver's session token, from the file {@code spark.hybridray.config} names (read
   * once per file: spark_bridge removes it once Spark has started), or "" if the config
   * names none (RayDP started by hand: memory and disk only). A file that cannot be read
   * fails the start: the session's remote tier would silently be lost otherwise.
   */
  static void loadDriverSessionToken(SparkConf conf) {
    try {
      withSession(new ObjectMapper().readTree(conf.get(CONF_CONFIG, "{}")), true);
    } catch (IOException e) {
      // A config that is not JSON: configNode() raises it where the config is needed.
    }
  }

  static synchronized String driverSessionToken(String path) {
    if (path == null || path.isEmpty()) {
      return "";
    }
    if (!path.equals(lastSessionFile)) {
      String token;
      try {
        token = new String(java.nio.file.Files.readAllBytes(java.nio.file.Paths.get(path)),
            java.nio.charset.StandardCharsets.UTF_8).trim();
      } catch (IOException e) {
        throw new IllegalStateException("hybrid_ray: cannot read the Spark session's token "
            + "file " + path + " (spark_bridge.init_spark writes it for the driver while "
            + "Spark starts): " + e, e);
      }
      if (!TOKEN.matcher(token).matches()) {
        throw new IllegalStateException("hybrid_ray: the Spark session's token file " + path
            + " does not hold a session token");
      }
      lastSessionFile = path;
      lastSessionToken = token;
    }
    return lastSessionToken;
  }

  /**
   * {@code config} as this JVM sends it to the actors: without the session file's path and,
   * on the {@code driver}, with the session token read from that file.
   */
  static JsonNode withSession(JsonNode config, boolean driver) {
    if (!(config instanceof ObjectNode)) {
      return config;
    }
    ObjectNode out = ((ObjectNode) config).deepCopy();
    JsonNode file = out.remove(SESSION_FILE_FIELD);
    if (file != null && driver) {
      String token = driverSessionToken(file.asText());
      if (!token.isEmpty()) {
        out.put(SESSION_FIELD, token);
      }
    }
    return out;
  }

  /** {@code config} with {@code token} as its session token (a copy). */
  static JsonNode withToken(JsonNode config, String token) {
    ObjectNode out = ((ObjectNode) config).deepCopy();
    out.put(SESSION_FIELD, token);
    return out;
  }

  /** The session token {@code config} holds ("" if none). */
  static String sessionToken(JsonNode config) {
    JsonNode token = config == null ? null : config.get(SESSION_FIELD);
    return token == null ? "" : token.asText();
  }

  /** The session token this JVM sends the actors ("" if none). */
  String sessionToken() {
    return sessionToken(configNode);
  }

  /**
   * Executors: send {@code token} (a shuffle handle's: the driver's session token) with
   * this JVM's requests from now on. An executor serves one Spark session, so every handle
   * carries the same token; an empty one (no session) changes nothing.
   */
  synchronized void adoptSession(String token) {
    JsonNode node = configNode;
    if (token == null || token.isEmpty() || !(node instanceof ObjectNode)
        || token.equals(sessionToken(node))) {
      return;
    }
    configNode = withToken(node, token);
  }

  /** This JVM's context (created from its SparkConf on first use). */
  public static synchronized HybridRayContext get(SparkConf conf) {
    if (instance == null) {
      instance = new HybridRayContext(conf);
    }
    return instance;
  }

  /** Whether a context exists in this JVM (built by {@link #get}, not reset since). */
  public static synchronized boolean exists() {
    return instance != null;
  }

  /** Forget the context (the SparkContext stopped; a new one may have other settings).
   *  What its sender holds is still sent. */
  static synchronized void reset() {
    if (instance != null) {
      instance.stopSender();
    }
    instance = null;
  }

  /** Stop taking work on the sender; what it holds is still sent. */
  void stopSender() {
    sender.shutdown();
  }

  /** The application part of shuffle ids: only characters hybrid_ray accepts in ids. */
  static String appKey(String appId) {
    String key = appId == null ? "app" : appId.replaceAll("[^A-Za-z0-9_.-]", "_");
    return key.length() > 80 ? key.substring(key.length() - 80) : key;
  }

  /**
   * What tells this Spark session's shuffles from another's under the same application id
   * (two drivers started in the same millisecond, an id set by hand, a driver restarted
   * under its old id): without it a new session took over the old one's shuffle state at
   * the master, and its readers could be served the old session's segments. When
   * {@code spark_bridge} started the session: the first 8 hex digits of the SHA-256 of its
   * session token (its Python side derives the same prefix), never the token's own
   * characters, since the token is the key the master hands the session's whole config
   * (remote-tier credentials included) out under, and ids are shown and logged. Without a
   * token, 8 random hex digits (only the driver makes shuffle ids; executors take them
   * from the handles).
   */
  static String sessionTag(JsonNode config) {
    JsonNode session = config == null ? null : config.get(SESSION_FIELD);
    String token = session == null ? "" : session.asText();
    if (token.isEmpty()) {
      return String.format("%08x", new java.security.SecureRandom().nextInt());
    }
    try {
      byte[] digest = java.security.MessageDigest.getInstance("SHA-256")
          .digest(token.getBytes(java.nio.charset.StandardCharsets.UTF_8));
      return String.format("%02x%02x%02x%02x", digest[0], digest[1], digest[2], digest[3]);
    } catch (java.security.NoSuchAlgorithmException e) {
      throw new IllegalStateException("this JVM has no SHA-256", e);
    }
  }

  /** hybrid_ray's id of a Spark shuffle: {@code spark-<app>-<session tag>-<shuffle id>}. */
  String shuffleKey(int shuffleId) {
    return "spark-" + appKey + "-" + shuffleId;
  }

  String appPrefix() {
    return "spark-" + appKey + "-";
  }

  String nodeId() {
    if (nodeId == null) {
      nodeId = Ray.getRuntimeContext().getCurrentNodeId().toString();
    }
    return nodeId;
  }

  /**
   * This node's spill dirs (from {@code spark.hybridray.config}): the only directories
   * whose disk segment files a reader here opens ({@link LocalSegmentFiles}).
   */
  List<String> spillDirs() throws IOException {
    if (spillDirs == null) {
      spillDirs = LocalSegmentFiles.spillDirs(parse(configJson), nodeId());
    }
    return spillDirs;
  }

  /**
   * The shuffle master actor could not be found: a fault of the control plane, which says
   * nothing about where map outputs are (readers fail their task rather than blame an
   * executor with a {@code FetchFailedException}).
   */
  static final class MasterNotRunningException extends IOException {
    private static final long serialVersionUID = 1L;

    MasterNotRunningException(String message) {
      super(message);
    }
  }

  PyActorHandle master() throws IOException {
    // Read once: another task's call may drop the cached handle (forgetActorHandles)
    // between a check and a second read, which then returned null.
    PyActorHandle handle = master;
    if (handle == null) {
      Optional<PyActorHandle> found = Ray.getActor(MASTER_NAME, namespace);
      master = handle = found.orElseThrow(() -> new MasterNotRunningException(
          "hybrid_ray's shuffle master (actor '" + MASTER_NAME + "' in Ray namespace '"
              + namespace + "') is not running: start Spark with spark_bridge.init_spark(), "
              + "or call hybrid_ray.actors.get_master('" + namespace + "') on the Ray "
              + "cluster before the first Spark job"));
    }
    return handle;
  }

  /**
   * The running tier manager of {@code node}, or empty; never starts one (a reader asking
   * another node for a segment must not start a tier manager whose books know none of it).
   * Cached like {@link #tierManager}: a lookup by name is a round trip to Ray's GCS, and a
   * reader asked once per segment on another node.
   */
  Optional<PyActorHandle> existingTierManager(String node) {
    PyActorHandle handle = tierManagers.get(node);
    if (handle != null) {
      return Optional.of(handle);
    }
    Optional<PyActorHandle> found = Ray.getActor(TIER_MANAGER_PREFIX + node, namespace);
    found.ifPresent(h -> tierManagers.put(node, h));
    return found;
  }

  /** The tier manager of {@code node}, started by the master if it is not running yet. */
  PyActorHandle tierManager(String node) throws IOException {
    PyActorHandle handle = tierManagers.get(node);
    if (handle != null) {
      return handle;
    }
    Optional<PyActorHandle> found = Ray.getActor(TIER_MANAGER_PREFIX + node, namespace);
    if (found.isEmpty()) {
      call(master(), "spark_tier_manager", node);
      found = Ray.getActor(TIER_MANAGER_PREFIX + node, namespace);
    }
    handle = found.orElseThrow(() -> new IOException(
        "hybrid_ray's tier manager of node " + node + " did not start"));
    tierManagers.put(node, handle);
    return handle;
  }

  /**
   * The IOException for a failed call. A call that found its actor gone (a tier manager
   * killed, say by Ray's memory monitor, and started again on demand under the same name)
   * drops every cached handle: kept, the dead one failed every later call of this JVM, so
   * each retry of a task failed the same way and Spark gave up on the stage. The next call
   * looks the actors up again.
   */
  IOException callFailed(String method, RuntimeException e) {
    if (isActorGone(e)) {
      forgetActorHandles();
    }
    return new IOException("hybrid_ray call " + method + " failed: " + e.getMessage(), e);
  }

  /** Whether {@code e}, or one of its causes, says the called actor died. */
  static boolean isActorGone(Throwable e) {
    return causedBy(e, RayActorException.class);
  }

  /** Whether {@code e} or one of its causes is an instance of one of {@code types}. */
  @SafeVarargs
  static boolean causedBy(Throwable e, Class<? extends Throwable>... types) {
    for (Throwable t = e; t != null; t = t.getCause() == t ? null : t.getCause()) {
      for (Class<? extends Throwable> type : types) {
        if (type.isInstance(t)) {
          return true;
        }
      }
    }
    return false;
  }

  /** Drop the cached master and tier-manager handles (looked up again on next use). */
  void forgetActorHandles() {
    master = null;
    tierManagers.clear();
  }

  /** Call a Python actor method taking and returning strings; errors become IOException. */
  String call(PyActorHandle actor, String method, String argument) throws IOException {
    try {
      return actor.task(PyActorMethod.of(method, String.class), argument).remote().get(callTimeoutMs);
    } catch (RuntimeException e) {
      throw callFailed(method, e);
    }
  }

  /**
   * Start a call of a Python actor method taking and returning strings, without waiting:
   * {@link #await} takes its answer. For a call whose round trip can overlap other work.
   */
  ObjectRef<String> callLater(PyActorHandle actor, String method, String argument) {
    return actor.task(PyActorMethod.of(method, String.class), argument).remote();
  }

  /** The answer of a call started with {@link #callLater}; errors become IOException. */
  String await(ObjectRef<String> pending, String method) throws IOException {
    return awaitWithin(pending, method, callTimeoutMs);
  }

  /** Like {@link #await}, waiting at most {@code waitMs} (and never past the call bound). */
  String awaitWithin(ObjectRef<String> pending, String method, long waitMs)
      throws IOException {
    try {
      return pending.get(Math.min(waitMs, callTimeoutMs));
    } catch (RuntimeException e) {
      throw callFailed(method, e);
    }
  }

  /** Call a Python actor method taking a string and bytes, returning a string. */
  String callWithBytes(PyActorHandle actor, String method, String argument, byte[] data)
      throws IOException {
    try {
      return actor.task(PyActorMethod.of(method, String.class), argument, data).remote().get(callTimeoutMs);
    } catch (RuntimeException e) {
      throw callFailed(method, e);
    }
  }

  /** A map attempt's last commit sent without waiting for its answer, and what it was
   *  for (for the log). */
  record SentCall(ObjectRef<String> answer, String what, int shuffleId, long mapId) {}

  /** A memory lease whose answer its task stopped waiting for. */
  record LateLease(ObjectRef<String> answer, PyActorHandle tierManager, String shuffleKey) {}

  /** Send a map attempt's last commit without waiting (from {@link #sender}); its failure
   *  is logged, and the attempt's objects here dropped, when seen
   *  ({@link #reportSentCommits}). */
  void commitLater(PyActorHandle master, String request, String what, int shuffleId,
      long mapId) {
    send(() -> sentCommits.add(new SentCall(callLater(master, "spark_commit", request), what,
        shuffleId, mapId)), what);
  }

  /** Give back the grant of a memory lease whose answer has not come yet, when it comes
   *  ({@link #giveBackLateLeases}), as a settlement of nothing written. */
  void giveBackWhenAnswered(ObjectRef<String> answer, PyActorHandle tierManager,
      String shuffleKey) {
    if (lateLeases.size() < MAX_SENT_COMMITS) {
      lateLeases.add(new LateLease(answer, tierManager, shuffleKey));
    } else {
      LOG.warn("hybrid_ray: too many late memory leases; the grant of one of shuffle {} "
          + "stays counted until the shuffle's release", shuffleKey);
    }
  }

  /** The {@code spark_settle} request giving back the whole grant of a lease answer
   *  ({@code {"lease": {"granted", "target", "books"}}}) with nothing written; null for a refused
   *  lease (nothing granted, nothing to give back). */
  static ObjectNode lateLeaseSettlement(ObjectMapper json, JsonNode answer, String shuffleKey) {
    JsonNode granted = answer.get("lease");
    if (granted == null || granted.isNull()) {
      return null;
    }
    ObjectNode request = json.createObjectNode();
    request.put("shuffle", shuffleKey);
    request.putArray("settle").addArray().add("memory").add(granted.get("granted").asLong())
        .add(granted.get("target").asText()).addNull().add(granted.path("books").asText(""));
    return request;
  }

  /** The calls of {@code queue} answered by now, taken off it; the others stay (at most
   *  {@link #MAX_SENT_COMMITS}) to be looked at again. One Ray.wait for all, never waiting
   *  (it hands back the very refs it was given). */
  private static <T> List<T> takeAnswered(ConcurrentLinkedQueue<T> queue,
      Function<T, ObjectRef<String>> answer) {
    List<T> pending = new ArrayList<>();
    for (T call = queue.poll(); call != null; call = queue.poll()) {
      pending.add(call);
    }
    if (pending.isEmpty()) {
      return pending;
    }
    List<ObjectRef<String>> answers = new ArrayList<>(pending.size());
    for (T call : pending) {
      answers.add(answer.apply(call));
    }
    Set<ObjectRef<String>> ready = Collections.newSetFromMap(new IdentityHashMap<>());
    ready.addAll(Ray.wait(answers, answers.size(), 0).getReady());
    List<T> answered = new ArrayList<>();
    for (T call : pending) {
      if (ready.contains(answer.apply(call))) {
        answered.add(call);
      } else if (queue.size() < MAX_SENT_COMMITS) {
        queue.add(call);  // not answered yet: look again later
      }
    }
    return answered;
  }

  /** Settle the late leases answered by now as unused (never waits). */
  private void giveBackLateLeases() {
    for (LateLease late : takeAnswered(lateLeases, LateLease::answer)) {
      try {
        ObjectNode request = lateLeaseSettlement(json, parse(late.answer().get(0)),
            late.shuffleKey());
        if (request != null) {
          late.tierManager().task(PyActorMethod.of("spark_settle", String.class),
              toJson(request)).remote();
        }
      } catch (IOException | RuntimeException e) {
        // The lease call failed (nothing granted), or the settlement could not be sent:
        // the grant then goes with the shuffle's release.
        LOG.debug("hybrid_ray: a late lease of shuffle {} not given back: {}",
            late.shuffleKey(), e.toString());
      }
    }
  }

  /** Run {@code submission} on {@link #sender}; a failure is logged as about {@code what}. */
  private void send(Runnable submission, String what) {
    try {
      sender.execute(() -> {
        try {
          submission.run();
        } catch (Throwable e) {  // an Error too: the executor's future would swallow it
          LOG.warn("hybrid_ray: sending {} failed: {}", what, e.toString());
        }
      });
    } catch (RejectedExecutionException e) {
      LOG.warn("hybrid_ray: {} not sent: this JVM's shuffle manager stopped", what);
    }
  }

  /**
   * Log the sent commits that failed, among those answered by now (never waits). A failed
   * last commit loses nothing: the attempt's readers find it missing, raise
   * FetchFailedException, and Spark runs the map again.
   */
  private void reportSentCommits() {
    for (SentCall sent : takeAnswered(sentCommits, SentCall::answer)) {
      try {
        sent.answer().get(0);
      } catch (RuntimeException e) {
        LOG.warn("hybrid_ray: the last commit of {} failed; readers will take its output "
            + "as lost and Spark will run it again: {}", sent.what(), e.getMessage());
        dropAttempt(sent.shuffleId(), sent.mapId());  // nobody will read its objects
      }
    }
  }

  /**
   * Wait, at most {@code timeoutMs}, until what was handed to {@link #sender} so far has
   * been sent (it runs one submission after the other), and let nothing be sent after: the
   * driver's Ray is about to shut down ({@link HybridRayShuffleManager#quiesceDriver}).
   */
  void drainSender(long timeoutMs) {
    try {
      sender.submit(() -> { }).get(timeoutMs, TimeUnit.MILLISECONDS);
    } catch (java.util.concurrent.ExecutionException | java.util.concurrent.TimeoutException
        | RejectedExecutionException e) {
      LOG.warn("hybrid_ray: calls queued to send did not finish before Ray's shutdown: {}",
          e.toString());
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
    }
    sender.shutdown();
  }

  /** Fire-and-forget call (space settlements: nobody waits for them), from
   *  {@link #sender}. */
  void callAsync(PyActorHandle actor, String method, String argument) {
    send(() -> actor.task(PyActorMethod.of(method, String.class), argument).remote(),
        "call " + method);
  }

  byte[] callBytes(PyActorHandle actor, String method, String argument) throws IOException {
    try {
      return actor.task(PyActorMethod.of(method, byte[].class), argument).remote().get(callTimeoutMs);
    } catch (RuntimeException e) {
      throw callFailed(method, e);
    }
  }

  /**
   * Whether Ray's node table lists {@code node} as alive (a node that died is listed dead
   * once Ray's health checks notice; until then a call to it fails or times out).
   */
  boolean nodeAlive(String node) {
    for (io.ray.api.runtimecontext.NodeInfo info : Ray.getRuntimeContext().getAllNodeInfo()) {
      if (info.nodeId.toString().equals(node)) {
        return info.isAlive;
      }
    }
    return false;
  }

  /** {@link #configJson} parsed once, with the session token in place of the session
   *  file (requests embed it). */
  JsonNode configNode() throws IOException {
    JsonNode node = configNode;
    if (node == null) {
      node = parse(configJson);  // not JSON: this raises
    }
    return node;
  }

  JsonNode parse(String text) throws IOException {
    return json.readTree(text);
  }

  String toJson(Object value) throws IOException {
    return json.writeValueAsString(value);
  }

  // ---- memory-tier objects owned by this JVM ----------------------------------------------
  // (see OwnedObjects)
  void own(int shuffleId, long mapId, ObjectRef<byte[]> ref) {
    owned.own(shuffleId, mapId, ref);
  }

  void dropAttempt(int shuffleId, long mapId) {
    if (owned.dropAttempt(shuffleId, mapId) > 0) {
      collectDroppedObjects();
    }
  }

  void dropShuffle(int shuffleId) {
    if (owned.dropShuffle(shuffleId) > 0) {
      collectDroppedObjects();
    }
    lastMapBytes.remove(shuffleId);
  }

  /**
   * Ask for a garbage collection soon, so the memory-tier objects whose refs were just
   * dropped leave the object store. Ray's Java runtime gives an object up only when the
   * {@code ObjectRefImpl} instances of it (this JVM's, and the readers' copies) are
   * collected, and offers no call to free one: after a shuffle's unregistration its
   * objects stayed in the store, measured 39 MiB of them 10 s later, until some GC ran,
   * which on an idle executor could be never, while the tier manager's books had
   * already given their memory back. Drops within {@link #COLLECT_DELAY_MS} share one
   * collection (Spark's own ContextCleaner runs System.gc() for its weak references too).
   */
  void collectDroppedObjects() {
    if (collectionScheduled.compareAndSet(false, true)) {
      try {
        sender.schedule(() -> {
          collectionScheduled.set(false);
          System.gc();
        }, COLLECT_DELAY_MS, TimeUnit.MILLISECONDS);
      } catch (RejectedExecutionException e) {
        collectionScheduled.set(false);  // shutting down: the JVM's exit frees them
      }
    }
  }

  void dropAll() {
    owned.dropAll();
    lastMapBytes.clear();
  }

  // ---- memory leases ----------------------------------------------------------------------
  /** Remember what a map task of {@code shuffleId} stored, to size the next one's lease. */
  void noteMapBytes(int shuffleId, long bytes) {
    lastMapBytes.put(shuffleId, bytes);
  }

  /** The memory lease for the next map task of {@code shuffleId} here (0: none). */
  long leaseBytesFor(int shuffleId) {
    return leaseSize(leaseBytes, flushBytes, lastMapBytes.get(shuffleId));
  }

  /** {@code first} before any task of the shuffle stored here; then the last task's bytes
   *  with a quarter more (tasks of a stage are alike), at most {@code cap}; 0 when leases
   *  are off ({@code first} 0) or the last task stored nothing. */
  static long leaseSize(long first, long cap, Long lastBytes) {
    if (first <= 0) {
      return 0;
    }
    long want = lastBytes == null ? first : lastBytes + lastBytes / 4;
    return Math.min(want, cap);
  }

  int ownedObjects(int shuffleId) {
    return owned.count(shuffleId);
  }
}
