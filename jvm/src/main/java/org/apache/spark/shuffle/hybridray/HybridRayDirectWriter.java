package org.apache.spark.shuffle.hybridray;

import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.io.OutputStream;
import org.apache.spark.Partitioner;
import org.apache.spark.ShuffleDependency;
import org.apache.spark.SparkEnv;
import org.apache.spark.TaskContext;
import org.apache.spark.io.CompressionCodec;
import org.apache.spark.io.CompressionCodec$;
import org.apache.spark.scheduler.MapStatus;
import org.apache.spark.scheduler.MapStatus$;
import org.apache.spark.serializer.SerializationStream;
import org.apache.spark.serializer.SerializerInstance;
import org.apache.spark.serializer.SerializerManager;
import org.apache.spark.shuffle.ShuffleWriteMetricsReporter;
import org.apache.spark.shuffle.ShuffleWriter;
import org.apache.spark.storage.ShuffleBlockId;
import scala.Option;
import scala.Product2;
import scala.collection.Iterator;

/**
 * The map-side writer of shuffles without map-side combine (the ones Spark would write with
 * its bypass-merge or serialized writer: every SQL exchange, {@code repartition}, joins'
 * inputs): it serializes each record at once into an in-memory buffer of its reduce
 * partition and hands the buffers to hybrid_ray's tiers whenever they reach
 * {@code spark.hybridray.flushBytes}, so map output never touches Spark's local dir.
 * (Spark's own bypass-merge writer writes one temp file per partition there first, and its
 * serialized writer writes at least one sorted spill file; with a small or full local disk
 * both fail with "No space left on device", which is what hybrid_ray's tiers are for.)
 *
 * <p>Two ways to buffer, as the serializer and codec allow:
 * <ul>
 *   <li><b>Relocatable</b> (Spark SQL's {@code UnsafeRowSerializer}, Kryo; a codec whose
 *   streams concatenate, no I/O encryption): records are kept serialized but uncompressed,
 *   and each flush compresses a partition's bytes as a stream of its own. A block's
 *   segments then hold several compressed streams back to back, which Spark's readers
 *   decompress as one (what its serialized writer's fast merge relies on too). Memory: the
 *   flush size.</li>
 *   <li><b>Stream per partition</b> (any other serializer): one serialization and
 *   compression stream per partition stays open for the whole task, and each flush takes
 *   the compressed bytes written so far. Memory: the flush size plus each partition's
 *   stream buffers, as Spark's bypass-merge writer; so used only up to Spark's bypass
 *   threshold (200 partitions: above it the manager gives such a shuffle to Spark's
 *   serialized writer, whose memory does not grow with the partition count).</li>
 * </ul>
 * Records are serialized before the next one is read, so Spark SQL may reuse its row
 * objects (it does not copy rows for a sort-based shuffle manager's bypass/serialized path).
 */
final class HybridRayDirectWriter<K, V> extends ShuffleWriter<K, V> {
  private final HybridRayContext ctx;
  private final HybridRayHandle handle;
  private final ShuffleDependency<K, V, ?> dependency;
  private final long mapId;
  private final TaskContext task;
  private final ShuffleWriteMetricsReporter metrics;
  private final PartitionSegmenter segmenter;
  private final RaySegmentSink sink;
  private final int numPartitions;
  /** {@link #relocatable(ShuffleDependency, SparkEnv)} of the dependency, asked once by the
   *  manager. */
  private final boolean relocatable;
  private boolean stopping;
  private MapStatus status;

  HybridRayDirectWriter(HybridRayContext ctx, HybridRayHandle handle,
      ShuffleDependency<K, V, ?> dependency, long mapId, TaskContext task,
      ShuffleWriteMetricsReporter metrics, boolean relocatable) {
    this.ctx = ctx;
    this.relocatable = relocatable;
    this.handle = handle;
    this.dependency = dependency;
    this.mapId = mapId;
    this.task = task;
    this.metrics = metrics;
    this.numPartitions = dependency.partitioner().numPartitions();
    this.segmenter = new PartitionSegmenter(handle.shuffleKey(), mapId, numPartitions,
        ctx.segmentBytes);
    this.sink = new RaySegmentSink(ctx, dependency.shuffleId(), handle.shuffleKey(),
        numPartitions, task.partitionId(), mapId);
  }

  /** Whether {@code dependency}'s records can be buffered serialized and compressed per
   *  flush (see the class comment). */
  static boolean relocatable(ShuffleDependency<?, ?, ?> dependency, SparkEnv env) {
    if (!dependency.serializer().supportsRelocationOfSerializedObjects()) {
      return false;
    }
    if (env.conf().getBoolean("spark.io.encryption.enabled", false)) {
      return false;
    }
    if (!env.conf().getBoolean("spark.shuffle.compress", true)) {
      return true;
    }
    CompressionCodec codec = CompressionCodec$.MODULE$.createCodec(env.conf());
    return CompressionCodec$.MODULE$.supportsConcatenationOfSerializedStreams(codec);
  }

  @Override
  public void write(Iterator<Product2<K, V>> records) throws IOException {
    // Asked for now, answered while the records are computed and partitioned.
    sink.startLease(ctx.leaseBytesFor(dependency.shuffleId()));
    SparkEnv env = SparkEnv.get();
    Partitioner partitioner = dependency.partitioner();
    SerializerInstance serializer = dependency.serializer().newInstance();
    Buffers buffers = relocatable
        ? new RelocatableBuffers(serializer, env.serializerManager())
        : new StreamBuffers(serializer, env.serializerManager());
    try {
      long records0 = 0;
      while (records.hasNext()) {
        Product2<K, V> record = records.next();
        K key = record._1();
        buffers.append(partitioner.getPartition(key), key, record._2());
        records0++;
        if (buffers.bufferedBytes() >= ctx.flushBytes) {
          flush(buffers, false);
        }
      }
      buffers.close();
      flush(buffers, true);
      metrics.incRecordsWritten(records0);
      status = MapStatus$.MODULE$.apply(env.blockManager().shuffleServerId(),
          segmenter.partitionLengths(), mapId);
    } catch (Throwable e) {
      // Errors too (Spark's SparkOutOfMemoryError from an operator upstream, an
      // AssertionError): Spark's ShuffleWriteProcessor catches only Exception, so no
      // stop(false) follows one, and the attempt's segments, pinned objects, lease and
      // grants stayed until the shuffle's release.
      sink.abort(e);
      throw e;
    }
  }

  /** Hand every partition's buffered bytes to the tiers (the last time: commit the map). */
  private void flush(Buffers buffers, boolean last) throws IOException {
    long start = System.nanoTime();
    segmenter.startRound();
    long bytes = 0;
    for (int p = 0; p < numPartitions; p++) {
      bytes += buffers.drain(p, segmenter);
    }
    segmenter.startRound();
    sink.store(segmenter.takePending(), last);
    metrics.incBytesWritten(bytes);
    metrics.incWriteTime(System.nanoTime() - start);
  }

  @Override
  public Option<MapStatus> stop(boolean success) {
    if (stopping) {
      return Option.empty();
    }
    stopping = true;
    if (success && status != null) {
      return Option.apply(status);
    }
    if (!success) {
      sink.abort(null);
    }
    return Option.empty();
  }

  @Override
  public long[] getPartitionLengths() {
    return segmenter.partitionLengths();
  }

  /** A byte buffer whose array is read in place (no copy per record or per drain). */
  static final class Bytes extends ByteArrayOutputStream {
    Bytes(int size) {
      super(size);
    }

    byte[] array() {
      return buf;
    }
  }

  private interface Buffers {
    void append(int partition, Object key, Object value) throws IOException;

    /** Bytes held but not yet drained (serialized or compressed). */
    long bufferedBytes();

    /** Move partition {@code p}'s bytes into {@code segmenter}; returns how many. */
    long drain(int p, PartitionSegmenter segmenter) throws IOException;

    /** No more records: complete the streams (compression trailers). */
    void close() throws IOException;
  }

  /** Serialized, uncompressed records per partition; compressed at each drain. */
  private final class RelocatableBuffers implements Buffers {
    private final Bytes record = new Bytes(1024);
    private final SerializationStream recordStream;
    private final SerializerManager serializerManager;
    private final Bytes[] raw = new Bytes[numPartitions];
    private final Bytes compressed = new Bytes(64 * 1024);
    private long held;

    RelocatableBuffers(SerializerInstance serializer, SerializerManager serializerManager) {
      this.recordStream = serializer.serializeStream(record);
      this.serializerManager = serializerManager;
    }

    @Override
    public void append(int partition, Object key, Object value) {
      record.reset();
      recordStream.writeKey(key, OBJECT_TAG);
      recordStream.writeValue(value, OBJECT_TAG);
      recordStream.flush();
      Bytes target = raw[partition];
      if (target == null) {
        target = raw[partition] = new Bytes(Math.max(1024, record.size()));
      }
      target.write(record.array(), 0, record.size());
      held += record.size();
    }

    @Override
    public long bufferedBytes() {
      return held;
    }

    @Override
    public long drain(int p, PartitionSegmenter segmenter) throws IOException {
      Bytes bytes = raw[p];
      if (bytes == null || bytes.size() == 0) {
        return 0;
      }
      compressed.reset();
      ShuffleBlockId block = new ShuffleBlockId(dependency.shuffleId(), mapId, p);
      try (OutputStream out = serializerManager.wrapStream(block, nonClosing(compressed))) {
        out.write(bytes.array(), 0, bytes.size());
      }
      held -= bytes.size();
      // Keep a modest buffer for the partition's next round, not its largest one.
      raw[p] = bytes.size() > (1 << 20) ? null : bytes;
      bytes.reset();
      segmenter.write(p, compressed.array(), 0, compressed.size());
      segmenter.finishPartition(p);
      return compressed.size();
    }

    @Override
    public void close() {
      recordStream.close();
    }
  }

  /** One open serialization + compression stream per partition for the whole task. */
  private final class StreamBuffers implements Buffers {
    private final SerializerInstance serializer;
    private final SerializerManager serializerManager;
    private final Bytes[] out = new Bytes[numPartitions];
    private final SerializationStream[] streams = new SerializationStream[numPartitions];
    private long held;

    StreamBuffers(SerializerInstance serializer, SerializerManager serializerManager) {
      this.serializer = serializer;
      this.serializerManager = serializerManager;
    }

    @Override
    public void append(int partition, Object key, Object value) {
      SerializationStream stream = streams[partition];
      if (stream == null) {
        out[partition] = new Bytes(32 * 1024);
        ShuffleBlockId block = new ShuffleBlockId(dependency.shuffleId(), mapId, partition);
        stream = streams[partition] = serializer.serializeStream(
            serializerManager.wrapStream(block, out[partition]));
      }
      long before = out[partition].size();
      stream.writeKey(key, OBJECT_TAG);
      stream.writeValue(value, OBJECT_TAG);
      held += out[partition].size() - before;
    }

    @Override
    public long bufferedBytes() {
      return held;
    }

    @Override
    public long drain(int p, PartitionSegmenter segmenter) {
      Bytes bytes = out[p];
      if (bytes == null || bytes.size() == 0) {
        return 0;
      }
      int n = bytes.size();
      segmenter.write(p, bytes.array(), 0, n);
      segmenter.finishPartition(p);
      bytes.reset();
      held -= n;
      return n;
    }

    @Override
    public void close() {
      for (int p = 0; p < numPartitions; p++) {
        if (streams[p] != null) {
          long before = out[p].size();
          streams[p].close();
          held += out[p].size() - before;
        }
      }
    }
  }

  /** {@code out}, but {@code close()} only flushes (the compressed bytes stay readable). */
  private static OutputStream nonClosing(OutputStream out) {
    return new java.io.FilterOutputStream(out) {
      @Override
      public void write(byte[] b, int off, int len) throws IOException {
        out.write(b, off, len);
      }

      @Override
      public void close() throws IOException {
        flush();
      }
    };
  }

  private static final scala.reflect.ClassTag<Object> OBJECT_TAG =
      scala.reflect.ClassTag$.MODULE$.Any();
}
