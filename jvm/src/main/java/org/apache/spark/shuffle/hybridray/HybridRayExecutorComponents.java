package org.apache.spark.shuffle.hybridray;

import java.util.Map;
import org.apache.spark.TaskContext;
import org.apache.spark.shuffle.api.ShuffleExecutorComponents;
import org.apache.spark.shuffle.api.ShuffleMapOutputWriter;

/**
 * Hands Spark's own shuffle writers (bypass-merge, serialized, sort) a map output writer
 * into hybrid_ray's tiers, so map-side combine, spilling while sorting, the serializer and
 * the compression codec stay exactly Spark's. A map attempt that fails before committing has what it stored removed.
 */
final class HybridRayExecutorComponents implements ShuffleExecutorComponents {
  private final HybridRayContext ctx;
  private final HybridRayHandle handle;
  private final TaskContext task;

  HybridRayExecutorComponents(HybridRayContext ctx, HybridRayHandle handle,
      TaskContext task) {
    this.ctx = ctx;
    this.handle = handle;
    this.task = task;
  }

  @Override
  public void initializeExecutor(String appId, String execId, Map<String, String> extraConfigs) {
  }

  @Override
  public ShuffleMapOutputWriter createMapOutputWriter(int shuffleId, long mapTaskId,
      int numPartitions) {
    RaySegmentSink sink = new RaySegmentSink(ctx, shuffleId, handle.shuffleKey(), numPartitions,
        task.partitionId(), mapTaskId);
    HybridRayMapOutputWriter writer = new HybridRayMapOutputWriter(
        new PartitionSegmenter(handle.shuffleKey(), mapTaskId, numPartitions, ctx.segmentBytes),
        sink, ctx.flushBytes);
    // Killed or failed before its commit: remove what the attempt stored.
    task.addTaskFailureListener(
        (org.apache.spark.util.TaskFailureListener) (context, error) -> writer.abort(error));
    return writer;
  }
}
